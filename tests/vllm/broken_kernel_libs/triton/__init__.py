raise ImportError("attnplug test: simulated broken triton install")
