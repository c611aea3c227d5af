"""The deepseek2 model and its build options (structure.py), which know nothing of the search above them.

Every correctness reference is cached under a hash of all of model/**/*.py (evaluator.gate.code_hash): editing any file
here invalidates every cached reference, and the next trial of each study makes its reference again.
"""
