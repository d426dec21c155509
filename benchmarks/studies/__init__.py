"""Studies of the learners: ours beside d3rlpy on the same data (``reference``), where the
critic's values sink (``critic_sink``), and what differential privacy costs in returns
(``privacy_cost``)."""
