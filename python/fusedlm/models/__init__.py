"""Models of the pretraining era on fusedlm's ops: BERT, GPT, ELECTRA and ELMo.

Each reads and writes checkpoints in the Hugging Face layout (``from_pretrained`` /
``save_pretrained``), so a directory written by ``transformers`` loads here and one
written here loads in ``transformers``.
"""
from ._pretrained import Config, KeyMap, KeyRule, PreTrainedModel
from .elmo import ELMo, ElmoBiLM, ElmoConfig
from .outputs import CausalLMOutput, ModelOutput, PreTrainingOutput, QuestionAnsweringOutput

__all__ = ["CausalLMOutput", "Config", "KeyMap", "KeyRule", "ModelOutput", "PreTrainedModel",
           "PreTrainingOutput", "QuestionAnsweringOutput", "ELMo", "ElmoBiLM", "ElmoConfig"]
