"""Operations: Prometheus metrics and interceptors, a local Prometheus server, learning-curve plots.

Layer 6: may import the layers below it (``common``, ``envs``, ``wire``)."""
