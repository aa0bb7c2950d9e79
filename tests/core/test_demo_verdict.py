"""The demos' last line (attnplug/tools/local_server.py): PASS only with equal tokens and attnplug's active
line in the server log, which it quotes; FAIL otherwise, with a non-zero status."""

from attnplug.tools.local_server import active_line, error_line, verdict

LOG = """INFO 12-05 07:00:01 [core.py:90] Initializing a V1 LLM engine
(EngineCore pid=4242) INFO 12-05 07:00:09 [backend.py:450] attnplug: ATTNPLUG_TRITON active (provider triton, \
layout NHD, page 16, cascade auto)
(EngineCore pid=4242) INFO 12-05 07:00:10 [backend.py:450] attnplug: ATTNPLUG_TRITON active (second worker)
"""


def test_active_line_is_the_first_from_the_marker_on():
    assert active_line(LOG, "attnplug: ATTNPLUG_TRITON active") == (
        "attnplug: ATTNPLUG_TRITON active (provider triton, layout NHD, page 16, cascade auto)"
    )
    assert active_line(LOG, "attnplug: attnplug_triton active") is None


def test_verdict(capsys):
    active = active_line(LOG, "attnplug: ATTNPLUG_TRITON active")
    assert verdict("vllm", True, "same 16 tokens", active) == 0
    assert capsys.readouterr().out == f'PASS vllm: same 16 tokens; active line: "{active}"\n'
    assert verdict("vllm", False, "tokens differ", active) == 1
    assert capsys.readouterr().out.startswith("FAIL vllm: tokens differ; active line: ")
    assert verdict("sglang", True, "5/5 prompts identical", None) == 1  # equal tokens, but attnplug did not run
    assert capsys.readouterr().out.startswith("FAIL sglang: attnplug's active line is missing")


def test_error_line_prefers_attnplugs_message():
    log = (
        "Traceback (most recent call last):\n  File x\nValueError: attnplug: ATTNPLUG_CASCADE must be 0, 1 or "
        "always, got 'bogus'\nRuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    assert error_line(log) == "ValueError: attnplug: ATTNPLUG_CASCADE must be 0, 1 or always, got 'bogus'"
    assert error_line("RuntimeError: no port\nshutting down\n") == "RuntimeError: no port"
    assert error_line("") == "(empty log)"
