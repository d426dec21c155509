"""Generated from protos/fedrl/v1 by `python -m fedrl.proto.generate`."""
