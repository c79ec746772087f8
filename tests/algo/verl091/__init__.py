"""verl 0.9.1 functions copied verbatim by scripts/verl_extract.py (see core_algos.py)."""
