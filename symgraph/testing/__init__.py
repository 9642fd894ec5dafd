"""Tiny models for tests, benchmarks, the demo and examples.

- ``models``     tiny random-weight transformers models built from configs (no download)
- ``diffusion``  tiny diffusers models (UNet, DiT, SD3, Flux, VAE) and their inputs
- ``device``     a test device that is not the CPU (``fakegpu``)
- ``quantize``   a simulated quantizer (RTN weights, per-token activations)
"""
