"""Models of the pretraining era as transformers models on fusedlm's fused ops: BERT,
RoBERTa, ALBERT, DistilBERT, ELECTRA and GPT-2 (transformers' classes, configs and
checkpoints), ELMo, and ULMFiT's AWD-LSTM; and sentence-transformers' pooling of an
encoder's token vectors into sentence vectors.

Each class named as in transformers subclasses ``transformers.PreTrainedModel``, takes
transformers' config class and loads the same checkpoints, so transformers' loader,
saver, output classes, pipelines, Trainer and generate serve it.
"""
try:
    import transformers  # noqa: F401
except ImportError as e:
    raise ImportError("fusedlm.models needs transformers: pip install 'fusedlm[hf]' "
                      "(fusedlm.ops, fusedlm.nn and fusedlm.patch do not)") from e

from .albert import (AlbertForMaskedLM, AlbertForPreTraining, AlbertForQuestionAnswering,
                     AlbertForSequenceClassification, AlbertForTokenClassification, AlbertModel,
                     AlbertPreTrainedModel)
from .awd_lstm import (AWDLSTMConfig, AWDLSTMForLanguageModeling, AWDLSTMForSequenceClassification,
                       AWDLSTMModel)
from .bert import (BertForMaskedLM, BertForPreTraining, BertForQuestionAnswering,
                   BertForSequenceClassification, BertForTokenClassification, BertModel,
                   BertPreTrainedModel)
from .distillation import Distiller, student_from_teacher
from .distilbert import (DistilBertForMaskedLM, DistilBertForQuestionAnswering,
                         DistilBertForSequenceClassification, DistilBertForTokenClassification,
                         DistilBertModel, DistilBertPreTrainedModel)
from .electra import (ElectraForJointPreTraining, ElectraForMaskedLM, ElectraForPreTraining,
                      ElectraForQuestionAnswering, ElectraForSequenceClassification,
                      ElectraForTokenClassification, ElectraModel, ElectraPreTrainedModel)
from .elmo import ELMo, ElmoBiLM, ElmoConfig
from .gpt import GPT2LMHeadModel, GPT2Model, GPT2PreTrainedModel
from .kv_cache import FusedKVCache
from .masking import mask_tokens
from .pooling import SentencePooling
from .roberta import (RobertaForMaskedLM, RobertaForQuestionAnswering,
                      RobertaForSequenceClassification, RobertaForTokenClassification, RobertaModel,
                      RobertaPreTrainedModel)

__all__ = ["AWDLSTMConfig", "AWDLSTMForLanguageModeling", "AWDLSTMForSequenceClassification",
           "AWDLSTMModel", "AlbertForMaskedLM", "AlbertForPreTraining", "AlbertForQuestionAnswering",
           "AlbertForSequenceClassification", "AlbertForTokenClassification", "AlbertModel",
           "AlbertPreTrainedModel", "BertForMaskedLM", "BertForPreTraining", "BertForQuestionAnswering",
           "BertForSequenceClassification", "BertForTokenClassification", "BertModel",
           "BertPreTrainedModel", "DistilBertForMaskedLM", "DistilBertForQuestionAnswering",
           "DistilBertForSequenceClassification", "DistilBertForTokenClassification",
           "DistilBertModel", "DistilBertPreTrainedModel", "Distiller", "ElectraForJointPreTraining", "ElectraForMaskedLM",
           "ElectraForPreTraining", "ElectraForQuestionAnswering", "ElectraForSequenceClassification",
           "ElectraForTokenClassification", "ElectraModel", "ElectraPreTrainedModel", "ELMo", "ElmoBiLM",
           "ElmoConfig", "FusedKVCache", "GPT2LMHeadModel", "GPT2Model", "GPT2PreTrainedModel",
           "mask_tokens", "student_from_teacher", "RobertaForMaskedLM", "RobertaForQuestionAnswering",
           "RobertaForSequenceClassification", "RobertaForTokenClassification", "RobertaModel",
           "RobertaPreTrainedModel", "SentencePooling"]
