"""The wire: weights as a manifest plus chunks (``codec``; the manifest and limits alone, without
torch, in ``manifest``), domain <-> protobuf (``serde``), servers,
channels, limits and status mapping (``rpc``), TLS and tokens (``security``, ``devca``), receive
buffers (``memory``) and the Control API client (``client.ControlClient``). With ``fedrl.proto``
(the generated stubs), the only core package that sees protobuf types.

Layer 5: may import the layers below it (it uses ``fedrl.common`` only)."""
