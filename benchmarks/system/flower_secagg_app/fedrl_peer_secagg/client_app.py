"""The ClientApp: a fit's parameters go back unchanged (no training, like the federation's zero
local steps). Under SecAgg+ the mod masks them; a plain round's messages pass it by."""

from flwr.client import ClientApp, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS


class Echo(NumPyClient):
    def fit(self, parameters, config):
        return parameters, 1, {}


def secagg_when_asked(msg, ctxt, call_next):
    """SecAgg+ for the rounds that run it (their messages carry its configs), else nothing."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, ctxt, call_next)
    return call_next(msg, ctxt)


app = ClientApp(client_fn=lambda context: Echo().to_client(), mods=[secagg_when_asked])
