"""What the models return: dataclasses with the field names ``transformers`` uses, so
code written against its outputs (``out.loss``, ``out.logits``, ...) reads these too.
Fields a model does not compute are None."""
from dataclasses import dataclass
from typing import Optional

from torch import Tensor


@dataclass
class ModelOutput:
    loss: Optional[Tensor] = None
    # None in training with labels when the loss came from a fused head that never
    # builds the full logits; real logits otherwise.
    logits: Optional[Tensor] = None
    last_hidden_state: Optional[Tensor] = None
    pooler_output: Optional[Tensor] = None
    hidden_states: Optional[tuple] = None  # the embeddings' output and each layer's


@dataclass
class PreTrainingOutput(ModelOutput):
    """BERT's masked LM + next-sentence heads; ELECTRA's generator + discriminator."""

    prediction_logits: Optional[Tensor] = None
    seq_relationship_logits: Optional[Tensor] = None


@dataclass
class CausalLMOutput(ModelOutput):
    past_key_values: Optional[object] = None


@dataclass
class QuestionAnsweringOutput(ModelOutput):
    start_logits: Optional[Tensor] = None
    end_logits: Optional[Tensor] = None


@dataclass
class ElectraPreTrainingOutput(PreTrainingOutput):
    """ELECTRA's joint step: ``loss`` = generator_loss + weight * discriminator_loss;
    ``logits`` are the discriminator's [batch, seq] (replaced or not); ``replaced_ids``
    is its input (the generator's samples at the masked positions) and
    ``replaced_labels`` its targets (1 where a sample differs from the original)."""

    generator_loss: Optional[Tensor] = None
    discriminator_loss: Optional[Tensor] = None
    replaced_ids: Optional[Tensor] = None
    replaced_labels: Optional[Tensor] = None
