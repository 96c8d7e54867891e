"""The DAG's stages, one module each: its ``Stage`` declaration (``STAGE``) next to its body, its
cache-key config, its catalog rows, its headline and what the summary, report and trackers read of
it. The library modules a stage's module imports are its source fingerprint
(``tasks.cache.stage_modules``). The table of stages in DAG order is ``tasks.dag.STAGES``.
"""
