"""One module per ``rlvr`` command, each exposing ``main(argv) -> int``: ``train`` (the RL loop),
``evaluate``, ``sft``, ``sft_instruct``, ``dpo``, ``demo`` and ``export``. ``rlvr.cli`` dispatches to them."""
