"""The reward layer: components (the math verifier, length and repetition shaping, DAPO's overlong
punishment, format) composed by ``reward.components``; what evaluation, curation and RL score with.
Formulas: docs/rewards.md."""
