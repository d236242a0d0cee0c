"""Scaling studies: run a grid of pretraining runs (`sweep`), tabulate them (`analyze`), fit power laws (`fit`).

    archscale sweep STUDY.yaml [--parallel N] [--dry_run] [--emit slurm|torchrun]
    archscale analyze STUDY_DIR
    archscale fit STUDY_DIR... | --csv FILE --x COL --y COL [--group COL]

See docs/STUDIES.md.
"""
