"""What the coverage benchmark measures against."""
from ..provenance import REPO_ROOT

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "coverage"

TASKS = {
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq_cls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "image_cls": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}

TOL = 1e-6
TARGET_COMPLETE = 0.95      # of the causal-LM families that trace
TARGET_MEDIAN_S = 5.0       # median analysis seconds per family, 2 cores
