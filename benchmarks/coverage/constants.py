"""What the coverage benchmark measures against."""
from ..provenance import REPO_ROOT

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "coverage"

TASKS = {
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq_cls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "image_cls": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "seq2seq_lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
    "speech_seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "audio_cls": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "image_text_to_text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "object_detection": "MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES",
    "semantic_segmentation": "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES",
}

TOL = 1e-6
TARGET_COMPLETE = 0.95      # of the causal-LM families that trace
TARGET_RUNS = 0.97          # sound and complete, of what transformers builds and runs
TARGET_MEDIAN_S = 5.0       # median analysis seconds per family, 2 cores
