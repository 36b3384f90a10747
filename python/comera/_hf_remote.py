"""Loads a model that comera saved with its tensor-train layers (``comera.torch``'s
``TTLinear`` / ``TTMEmbedding``): written beside the weights as ``modeling_comera.py`` by
``comera.torch.save_pretrained`` and ``comera.Run.export_hf(dir, compressed=True)``.

    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(dir, trust_remote_code=True)

gives the saved model (e.g. a ``BertForSequenceClassification``) with its TT layers and
their cores, as ``comera.torch.from_pretrained(dir)`` does. It needs the ``comera`` Python
package with torch where the model is loaded. The weights are in
``comera_model.safetensors``, not ``model.safetensors``: a loader that does not know this
format finds no weights and stops, instead of filling the TT layers' places with random
dense ones.
"""

from transformers import PretrainedConfig, PreTrainedModel


class ComeraConfig(PretrainedConfig):
    """The saved model's own config (``comera["base_config"]``), its class
    (``comera["architecture"]``) and its comera layers (``comera["layers"]``)."""

    model_type = "comera"

    def __init__(self, comera=None, **kwargs):
        self.comera = comera or {}
        super().__init__(**kwargs)


class ComeraModel(PreTrainedModel):
    """A loader only: ``from_pretrained`` returns the saved model's own class."""

    config_class = ComeraConfig

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        try:
            import comera.torch as ct
        except ImportError as e:
            raise ImportError(
                "this model holds comera TT layers: loading it needs the comera package with "
                f"torch ({e})"
            ) from None
        return ct.from_pretrained(pretrained_model_name_or_path)
