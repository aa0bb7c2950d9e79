"""Runnable tools outside the library proper: the demos (``python -m attnplug.tools.demo``,
``attnplug.tools.demo_vllm``, ``attnplug.tools.demo_sglang``), the tiny random-weight test model
(``attnplug.tools.tiny_model``) and the local-server helpers they share (``attnplug.tools.local_server``)."""
