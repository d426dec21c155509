"""Round logic shared by the in-process simulator and the gRPC services; pure aggregation; run
settings.

Layer 7: may import every layer below it."""
