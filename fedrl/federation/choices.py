"""The names a run's aggregation settings take, without torch (``fedrl ctl`` checks a run's
settings before sending them and never loads it); :mod:`fedrl.federation.aggregate` implements them."""

WEIGHTINGS = ("uniform", "samples")
AGGREGATIONS = ("fedavg", "median", "trimmed-mean")
FEDERATE_CHOICES = ("policy", "policy+critic")  # what is averaged: the policy (paper) or it and the critics
