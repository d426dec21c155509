"""Round logic shared by the in-process simulator and the gRPC services."""
