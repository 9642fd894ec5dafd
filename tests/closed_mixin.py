"""A generation mixin in a file of its own, as transformers keeps VibeVoice's: it decodes
through a method of a tower that its host never calls."""


class DecodeMixin:
    def decode_ids(self, ids):
        return self.host.tower.decode(ids)


class FreezeMixin:
    """Freezes its module's parameters, reached by no name (as transformers' model mixins do)."""

    def freeze(self):
        for p in self.parameters():
            p.requires_grad_(False)
