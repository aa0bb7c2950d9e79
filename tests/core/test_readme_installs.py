"""scripts/check_readme_installs.py reads README's install lines and checks what their comments state
(the resolving itself needs PyPI: the package suite of scripts/test.sh runs it)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_readme_installs", ROOT / "scripts" / "check_readme_installs.py")
cri = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cri)


def test_readme_install_lines_are_found():
    lines = dict(cri.install_lines((ROOT / "README.md").read_text()))
    assert len(lines) >= 5, lines
    assert "pip install vllm==0.26.0 '.[triton,flashinfer]'" in lines
    assert "pip install sglang==0.5.17 '.[triton,flashinfer]'" in lines
    assert "pip install '.[triton]'" in lines
    assert cri.claims(lines["pip install vllm==0.26.0 '.[triton,flashinfer]'"]) == [
        ("torch", "==", "2.11.0"),
        ("triton", "==", "3.6.0"),
    ]


def test_only_bash_blocks_count():
    text = "```\npip install not-this\n```\n```bash\npip install a  # torch >= 2.4\nx\n```\npip install nor-this\n"
    assert cri.install_lines(text) == [("pip install a", "torch >= 2.4")]


def test_check_claims():
    comment = "vLLM 0.26: torch 2.11.0, triton >= 3.6"
    assert cri.check_claims({"torch": "2.11.0+cu130", "triton": "3.7.1"}, comment) == []
    assert cri.check_claims({"torch": "2.13.0", "triton": "3.5.0"}, comment) == [
        "the comment says torch == 2.11.0, pip picks 2.13.0",
        "the comment says triton >= 3.6, pip picks 3.5.0",
    ]
    assert cri.check_claims({}, "triton >= 3.7") == ["the comment says triton >= 3.7, pip picks None"]
