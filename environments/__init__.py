"""Environments: multi-turn episodes, tools and the sandbox (``environments.sandbox.run``).

Layer (DESIGN.md): above ``rewards``, below the stage libraries; imports core, conf, generation and
rewards only. Single-turn prompts are the one-turn case of an episode.
"""
