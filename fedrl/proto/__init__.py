"""Generated gRPC stubs (package fedrl.v1 on the wire)."""
