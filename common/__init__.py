"""Shared, unit-tested building blocks of the RL-for-flow-matching scripts."""

import logging


class _DropTorchvisionFallbackNotice(logging.Filter):
    """transformers 5 says, once per class, "`CLIPImageProcessor` requires torchvision (not
    installed); falling back to `CLIPImageProcessorPil`" when diffusers' SD3/FLUX pipeline modules
    import their (unused) image-encoder processors, and when a CLIP reward reads its processor
    config. Nothing here runs those processors on images (common/rewards.py preprocesses tensors
    itself), so the notice asks the user to act on something that does not affect the run: drop
    exactly that message, from exactly that logger, and let every other transformers warning
    through."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (
            "requires torchvision (not installed); falling back to" in msg
            and "ImageProcessorPil" in msg
        )


# transformers logs it through logging.getLogger("transformers.utils.import_utils"); a filter set on
# that logger before transformers is imported stays on it (transformers configures handlers on its
# root logger, not filters).
logging.getLogger("transformers.utils.import_utils").addFilter(_DropTorchvisionFallbackNotice())
