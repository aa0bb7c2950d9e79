"""attnplug: one paged-attention core for LLM serving, driven by vLLM and SGLang.

Importing attnplug never imports an engine, a GPU library or a provider: every optional piece is
loaded lazily, so an installed-but-unselected attnplug cannot break the engine beside it.
"""

__version__ = "0.1.0"
