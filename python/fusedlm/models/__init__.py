"""Models of the pretraining era on fusedlm's ops: BERT, GPT, ELECTRA and ELMo.

Each reads and writes checkpoints in the Hugging Face layout (``from_pretrained`` /
``save_pretrained``), so a directory written by ``transformers`` loads here and one
written here loads in ``transformers``.
"""
from ._pretrained import Config, KeyMap, KeyRule, PreTrainedModel
from .gpt import GPTConfig, GPTLMHeadModel, GPTModel
from .outputs import CausalLMOutput, ModelOutput, PreTrainingOutput, QuestionAnsweringOutput

__all__ = ["CausalLMOutput", "Config", "GPTConfig", "GPTLMHeadModel", "GPTModel", "KeyMap",
           "KeyRule", "ModelOutput", "PreTrainedModel", "PreTrainingOutput",
           "QuestionAnsweringOutput"]
