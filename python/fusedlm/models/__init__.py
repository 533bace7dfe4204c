"""Models of the pretraining era as transformers models on fusedlm's fused ops: BERT,
ELECTRA and GPT-2 (transformers' classes, configs and checkpoints), and ELMo.

Each class named as in transformers subclasses ``transformers.PreTrainedModel``, takes
transformers' config class and loads the same checkpoints, so transformers' loader,
saver, output classes, pipelines, Trainer and generate serve it.
"""
from .bert import (BertForMaskedLM, BertForPreTraining, BertForQuestionAnswering,
                   BertForSequenceClassification, BertForTokenClassification, BertModel,
                   BertPreTrainedModel)
from .masking import mask_tokens

__all__ = ["BertForMaskedLM", "BertForPreTraining", "BertForQuestionAnswering",
           "BertForSequenceClassification", "BertForTokenClassification", "BertModel",
           "BertPreTrainedModel", "mask_tokens"]
