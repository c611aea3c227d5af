"""tests/test_space_glm.py's proof for the Q8_0, Q4_K_M and F16 mixes: their backend knobs."""
from test_space_glm import (  # noqa: F401
    pytest_generate_tests,
    test_glm_knob_is_equivalent_and_changes_the_kernels,
    test_glm_model_info,
)

MIXES = ("q8_0", "q4_k_m", "f16")
