"""What attnplug relies on in the libraries and engines it plugs into, checked from their sources.

:mod:`attnplug.compat.contract` is the source-level checker the adapters' ``compat.py`` contracts run
(engine releases outside the tested range); :mod:`attnplug.compat.flashinfer` states the flashinfer
provider's calls as checker items, so its tests can hold them against each FlashInfer release's sources.
"""
