"""The paper and its reproduction: presets and their cells (``presets``), running them
(``cells``; ``python -m benchmarks.paper``), their tables and figures (``tables``, ``plots``),
the runs made for a lent GPU (``device``, ``device_claim``), and the verdict at the paper's
per-agent budget (``verdict``)."""
