"""The general-assistant evaluations: MMLU (knowledge), GSM8K (reasoning), AlpacaEval (chat
quality, judged pairwise) and SimpleSafetyTests (safety, judged), run by ``rlvr eval --suite``.

``parsing`` holds the answer parsers, ``data`` the loaders, ``judge`` the model judges and their
scores, ``run`` the prompting modes, the runner and the command line."""

from rlvr.suites.parsing import parse_gsm8k_response, parse_mmlu_response

__all__ = ["parse_gsm8k_response", "parse_mmlu_response"]
