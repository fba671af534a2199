"""The task of a run: its examples (``data``, ``data_order``, ``example``, the generated tasks in
``generated``), how they are asked (``prompts``, ``chat``, ``instruction_data``) and how answers are scored
(``grading`` extracts and grades answers; ``rewards`` names reward functions and runs them, with
``reward_worker``, ``remote_reward`` and ``code_reward``). ``build`` turns a config into all three.
Import from the modules; the package itself loads nothing."""
