"""The training core every trainer shares: log-probs of responses (``logprobs``, ``fused_logprobs``), packed
and padded batches (``packing``, ``tokenize``), the policy-gradient step (``train_step``), and what keeps a
run whole (``optim``, ``lora``, ``checkpoint``, ``rundir``, ``interrupts``, ``scaffold``, ``metrics_log``,
``health``). Import from the modules; the package itself loads nothing."""
