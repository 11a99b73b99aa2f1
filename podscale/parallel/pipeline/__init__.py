"""Pipeline parallelism on the ``pp`` axis (Huang et al. 2019; Narayanan et al. 2021).

partition.py  the GPT cut into model chunks (balanced by parameters or measured time, or user-given)
schedule.py   GPipe, 1F1B and interleaved 1F1B as per-rank action lists, an ideal-machine simulator, and the
              PipelineParallel strategy that executes them with tagged point-to-point sends
compose.py    build_engine: pp -> tp/sp -> dp strategy (replicated or ZeRO) -> one Engine, from a config
"""
