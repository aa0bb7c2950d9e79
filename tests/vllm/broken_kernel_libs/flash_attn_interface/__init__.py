raise ImportError("attnplug test: simulated broken flash_attn_interface install")
