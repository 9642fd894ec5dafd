"""Token ids a shrunk config must state for its forward to read a tower (see :mod:`.shrink`)."""
from __future__ import annotations

__all__ = ["audio_token"]

_AUDIO_TOKEN = ("audio_token_id", "audio_token_index")


def audio_token(fields, out, free_id: int) -> dict:
    """An audio token left None on a level that holds an audio config (Voxtral's default): its
    forward puts the audio tower's embeddings at the tokens of that id, so a config without one
    never reads its audio tower (real checkpoints state one: Voxtral Mini's is 24). The shrunk
    config's is ``free_id``, the highest id no other token takes, or the next below where another
    rule of this level (:func:`.consistent.query_image_tokens`) took that one."""
    if fields.get("audio_config") is None:
        return {}
    taken = {v for v in out.values() if isinstance(v, int) and not isinstance(v, bool)}
    token = free_id if free_id not in taken else free_id - 1
    return {k: token for k in _AUDIO_TOKEN if k in fields and fields[k] is None}
