"""Models of the pretraining era on fusedlm's ops: BERT, GPT, ELECTRA and ELMo.

Each reads and writes checkpoints in the Hugging Face layout (``from_pretrained`` /
``save_pretrained``), so a directory written by ``transformers`` loads here and one
written here loads in ``transformers``.
"""
from ._pretrained import Config, KeyMap, KeyRule, PreTrainedModel
from .bert import (BertConfig, BertForMaskedLM, BertForPreTraining, BertForQuestionAnswering,
                   BertForSequenceClassification, BertForTokenClassification, BertModel)
from .electra import (ElectraConfig, ElectraDiscriminator, ElectraForPreTraining,
                      ElectraForQuestionAnswering, ElectraForSequenceClassification,
                      ElectraForTokenClassification, ElectraGenerator, ElectraModel)
from .elmo import ELMo, ElmoBiLM, ElmoConfig
from .gpt import GPTConfig, GPTLMHeadModel, GPTModel
from .masking import mask_tokens
from .outputs import (CausalLMOutput, ElectraPreTrainingOutput, ModelOutput, PreTrainingOutput,
                      QuestionAnsweringOutput)

__all__ = ["BertConfig", "BertForMaskedLM", "BertForPreTraining", "BertForQuestionAnswering",
           "BertForSequenceClassification", "BertForTokenClassification", "BertModel",
           "CausalLMOutput", "Config", "ElectraConfig", "ElectraDiscriminator",
           "ElectraForPreTraining", "ElectraForQuestionAnswering",
           "ElectraForSequenceClassification", "ElectraForTokenClassification",
           "ElectraGenerator", "ElectraModel", "ElectraPreTrainingOutput", "ELMo", "ElmoBiLM",
           "ElmoConfig", "GPTConfig",
           "GPTLMHeadModel", "GPTModel", "KeyMap", "KeyRule", "ModelOutput", "PreTrainedModel",
           "PreTrainingOutput", "QuestionAnsweringOutput", "mask_tokens"]
