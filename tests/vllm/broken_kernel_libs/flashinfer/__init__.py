raise ImportError("attnplug test: simulated broken flashinfer install")
