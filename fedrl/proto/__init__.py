"""Generated gRPC stubs (package fedrl.v1 on the wire); part of the wire layer (layer 5)."""
