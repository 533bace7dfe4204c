"""ELMo (Peters et al., 2018) as AllenNLP runs it, on fusedlm's lstm_cell and masked_lm_loss.

A word is read character by character: its UTF-8 bytes, between begin- and end-of-word
markers, go through a character CNN (max over positions), highway layers and a
projection. A two-layer bidirectional LSTM with projection runs over the sentence with
begin- and end-of-sentence tokens added; its cell and projected state are clipped, and the
second layer adds its input to its output. ELMo's vectors are learned mixes of the three
layers, ``gamma * sum_j softmax(s)_j h_j``; ``ElmoBiLM`` trains the two LSTMs as language
models (the forward one predicts the next word, the backward one the previous word).

``ELMo.from_allennlp(options_file, weight_file)`` reads AllenNLP's released checkpoints.
The config and models are transformers' (``PretrainedConfig``, ``PreTrainedModel``), so
``save_pretrained`` / ``from_pretrained`` (config.json + model.safetensors), ``.device``,
``.dtype`` and activation checkpointing are theirs.
"""
import functools
import json
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.utils import ModelOutput

from .. import ops
from ..ops.lstm_cell import lstm_cell
from ._lstm import recur, reverse_within, time_major

# The character ids of AllenNLP's ELMoCharacterMapper: bytes are 0-255, then the markers.
# Every id is stored plus one, so that 0 is the padding of tokens past a sentence's end.
BEGIN_SENTENCE, END_SENTENCE, BEGIN_WORD, END_WORD, PADDING = 256, 257, 258, 259, 260
BOS_TOKEN, EOS_TOKEN = "<S>", "</S>"


# --- characters ----------------------------------------------------------------------------------

def _marker_ids(marker: int, max_chars: int) -> list:
    ids = [PADDING] * max_chars
    ids[:3] = [BEGIN_WORD, marker, END_WORD]
    return [i + 1 for i in ids]


def word_to_char_ids(word: str, max_characters_per_token: int = 50) -> list:
    """The character ids of one word: its UTF-8 bytes (cut to leave room for the two
    markers) between begin- and end-of-word, padded; "<S>" and "</S>" are the sentence
    markers."""
    if max_characters_per_token < 3:
        raise ValueError(f"max_characters_per_token must be at least 3, got {max_characters_per_token}")
    if word == BOS_TOKEN:
        return _marker_ids(BEGIN_SENTENCE, max_characters_per_token)
    if word == EOS_TOKEN:
        return _marker_ids(END_SENTENCE, max_characters_per_token)
    encoded = word.encode("utf-8", "ignore")[: max_characters_per_token - 2]
    ids = [BEGIN_WORD, *encoded, END_WORD]
    ids += [PADDING] * (max_characters_per_token - len(ids))
    return [i + 1 for i in ids]


def batch_to_ids(sentences: Sequence[Sequence[str]], max_characters_per_token: int = 50) -> Tensor:
    """int64 [batch, longest sentence, max_characters_per_token] character ids of tokenized
    sentences; tokens past a sentence's end are all 0."""
    if isinstance(sentences, str) or any(isinstance(s, str) for s in sentences):
        raise TypeError("sentences must be a list of tokenized sentences (lists of str)")
    longest = max((len(s) for s in sentences), default=0)
    out = torch.zeros(len(sentences), longest, max_characters_per_token, dtype=torch.long)
    for b, sentence in enumerate(sentences):
        for t, word in enumerate(sentence):
            out[b, t] = torch.tensor(word_to_char_ids(word, max_characters_per_token))
    return out


def add_sentence_markers(char_ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """char_ids [batch, seq, chars] with begin-of-sentence before each sentence and
    end-of-sentence after its last token: [batch, seq + 2, chars], and its mask."""
    batch, seq, chars = char_ids.shape
    lengths = mask.sum(dim=1)
    out = char_ids.new_zeros(batch, seq + 2, chars)
    out[:, 1:-1] = char_ids
    rows = torch.arange(batch, device=char_ids.device)
    out[rows, 0] = char_ids.new_tensor(_marker_ids(BEGIN_SENTENCE, chars))
    out[rows, lengths + 1] = char_ids.new_tensor(_marker_ids(END_SENTENCE, chars))
    return out, torch.arange(seq + 2, device=mask.device) < (lengths + 2)[:, None]


# --- config --------------------------------------------------------------------------------------

def _default_filters():
    return [[1, 32], [2, 32], [3, 64], [4, 128], [5, 256], [6, 512], [7, 1024]]


@strict
class ElmoConfig(PretrainedConfig):
    """The fields of AllenNLP's options.json (``char_cnn`` and ``lstm``), flattened, plus
    the settings of its Elmo module (the mixes) and, for ElmoBiLM, the word vocabulary.
    Defaults are the original ELMo (2x4096_512_2048cnn_2xhighway). Keyword arguments
    only; a value of the wrong type or out of range raises, naming the field."""

    model_type = "elmo"

    char_embedding_dim: int = 16
    filters: list = field(default_factory=_default_filters)  # [[width, channels], ...]
    n_highway: int = 2
    n_characters: int = 262  # rows of the character embedding, row 0 the padding
    max_characters_per_token: int = 50
    activation: str = "relu"  # of the convolutions: "relu" or "tanh"
    lstm_dim: int = 4096  # the cell
    projection_dim: int = 512
    n_layers: int = 2
    cell_clip: float | int | None = 3.0
    proj_clip: float | int | None = 3.0
    use_skip_connections: bool = True
    num_output_representations: int = 1  # scalar mixes
    do_layer_norm: bool = False  # normalise each layer before mixing
    dropout: float | int = 0.5  # on the mixed representations
    vocab_size: int = 0  # ElmoBiLM's softmax
    # A model built from the config turns activation checkpointing on (each LSTM layer is
    # recomputed in the backward) and, as transformers does, removes the flag from it.
    gradient_checkpointing: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.activation not in ("relu", "tanh"):
            raise ValueError(f"activation must be 'relu' or 'tanh', got {self.activation!r}")
        widest = max((w for w, _ in self.filters), default=0)
        if not self.filters or widest > self.max_characters_per_token:
            raise ValueError(f"filters must be a non-empty list of [width, channels] with widths "
                             f"<= max_characters_per_token, got {self.filters!r}")
        for name in ("cell_clip", "proj_clip"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be None or > 0, got {value!r}")
        for name in ("lstm_dim", "projection_dim", "n_layers", "num_output_representations"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")

    @classmethod
    def from_options(cls, options: dict, **overrides) -> "ElmoConfig":
        """The config of an AllenNLP options.json (as a dict)."""
        cnn, lstm = options["char_cnn"], options["lstm"]
        values = dict(
            char_embedding_dim=cnn["embedding"]["dim"], filters=[list(f) for f in cnn["filters"]],
            n_highway=cnn["n_highway"], n_characters=cnn["n_characters"],
            max_characters_per_token=cnn["max_characters_per_token"],
            activation=cnn.get("activation", "relu"), lstm_dim=lstm["dim"],
            projection_dim=lstm["projection_dim"], n_layers=lstm["n_layers"],
            cell_clip=lstm.get("cell_clip"), proj_clip=lstm.get("proj_clip"),
            use_skip_connections=lstm.get("use_skip_connections", True))
        return cls(**{**values, **overrides})


# --- modules -------------------------------------------------------------------------------------

class CharacterEncoder(nn.Module):
    """Character ids [batch, seq, chars] -> word vectors [batch, seq, projection_dim]."""

    def __init__(self, config: ElmoConfig):
        super().__init__()
        self.activation = torch.relu if config.activation == "relu" else torch.tanh
        self.embedding = nn.Embedding(config.n_characters, config.char_embedding_dim, padding_idx=0)
        self.convs = nn.ModuleList(nn.Conv1d(config.char_embedding_dim, channels, width)
                                   for width, channels in config.filters)
        n_filters = sum(channels for _, channels in config.filters)
        self.highways = nn.ModuleList(Highway(n_filters) for _ in range(config.n_highway))
        self.projection = nn.Linear(n_filters, config.projection_dim)

    def forward(self, char_ids: Tensor) -> Tensor:
        batch, seq, chars = char_ids.shape
        x = self.embedding(char_ids.view(-1, chars)).transpose(1, 2)  # [words, dim, chars]
        # Max over positions, then the activation (as AllenNLP, and the same for relu).
        x = torch.cat([self.activation(conv(x).amax(dim=-1)) for conv in self.convs], dim=-1)
        for highway in self.highways:
            x = highway(x)
        return self.projection(x).view(batch, seq, -1)


class Highway(nn.Linear):
    """AllenNLP's highway layer: one product gives the transform (first half) and the
    gate, and gate * x + (1 - gate) * relu(transform) leaves."""

    def __init__(self, size: int):
        super().__init__(size, 2 * size)

    def forward(self, x: Tensor) -> Tensor:
        transform, gate = super().forward(x).chunk(2, dim=-1)
        gate = torch.sigmoid(gate)
        return gate * x + (1 - gate) * torch.relu(transform)


class LstmDirection(nn.Module):
    """One direction of one layer: AllenNLP's LstmCellWithProjection (same parameter names).

    The input's share of the gates, W_i x_t, is one product over all steps; each step adds
    W_h h_{t-1} + b, runs fusedlm's lstm_cell (cell clip) and projects (projection clip).
    Past a sequence's end the state is kept and the output is zero, so the backward
    direction, which starts from the last position, begins each sequence at its own end.
    """

    def __init__(self, input_size: int, config: ElmoConfig, go_forward: bool):
        super().__init__()
        self.go_forward = go_forward
        self.cell_clip, self.proj_clip = config.cell_clip, config.proj_clip
        cell, proj = config.lstm_dim, config.projection_dim
        self.input_linearity = nn.Linear(input_size, 4 * cell, bias=False)
        self.state_linearity = nn.Linear(proj, 4 * cell)
        self.state_projection = nn.Linear(cell, proj, bias=False)
        # Without clipping the step is a plain LSTM with projection, which torch's (cuDNN's)
        # LSTM runs on these parameters (it needs a projection narrower than the cell).
        self.use_torch_lstm = self.cell_clip is None and self.proj_clip is None and proj < cell

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """x [batch, seq, input], mask bool [batch, seq] (True = token) -> [batch, seq, proj]."""
        if self.use_torch_lstm:
            return self._torch_forward(x, mask)
        weight = self.state_linearity.weight.t()  # [proj, 4 * cell]
        # The input's share of the gates and the bias, every step at once: each step then
        # adds W_h h in one addmm on a contiguous block.
        inputs = time_major(self.input_linearity(x) + self.state_linearity.bias)
        h = weight.new_zeros(x.shape[0], weight.shape[0])
        c = weight.new_zeros(x.shape[0], self.state_projection.weight.shape[1])
        outputs, _ = recur(functools.partial(self._step, weight=weight), inputs, (h, c), mask,
                           self.go_forward)
        return outputs

    def _step(self, x_t: Tensor, state: tuple, weight: Tensor) -> tuple:
        h, c = state
        gates = torch.addmm(x_t, h, weight)
        # The cell state stays in the parameters' dtype under autocast.
        cell_out, c_new = lstm_cell(gates.to(c.dtype), c, cell_clip=self.cell_clip)
        h_new = self.state_projection(cell_out)
        if self.proj_clip is not None:
            h_new = torch.clamp(h_new, -self.proj_clip, self.proj_clip)
        return h_new, (h_new.to(h.dtype), c_new)

    def _torch_forward(self, x: Tensor, mask: Tensor) -> Tensor:
        lengths = mask.sum(dim=1)
        if not self.go_forward:
            x = reverse_within(x, lengths)
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True,
                                                   enforce_sorted=False)
        b_hh = self.state_linearity.bias
        params = {"weight_ih_l0": self.input_linearity.weight,
                  "weight_hh_l0": self.state_linearity.weight,
                  "bias_ih_l0": torch.zeros_like(b_hh), "bias_hh_l0": b_hh,
                  "weight_hr_l0": self.state_projection.weight}
        cell, proj = self.state_projection.weight.shape[1], self.state_projection.weight.shape[0]
        # A shell on the meta device: functional_call runs it on the parameters above.
        shell = nn.LSTM(x.shape[-1], cell, proj_size=proj, batch_first=True, device="meta")
        out, _ = torch.func.functional_call(shell, params, (packed,))
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return out if self.go_forward else reverse_within(out, lengths)


class ElmoLstm(nn.Module):
    """The stacked biLSTM: forward and backward layers each read their own direction's
    previous layer (never the concatenation); layers after the first add their input."""

    def __init__(self, config: ElmoConfig):
        super().__init__()
        self.skip = config.use_skip_connections
        # transformers' gradient_checkpointing_enable sets it and _gradient_checkpointing_func
        # (as does a model built from a config with gradient_checkpointing=True).
        self.gradient_checkpointing = False
        size = config.projection_dim
        self.forward_layers = nn.ModuleList(LstmDirection(size, config, True)
                                            for _ in range(config.n_layers))
        self.backward_layers = nn.ModuleList(LstmDirection(size, config, False)
                                             for _ in range(config.n_layers))

    def forward(self, x: Tensor, mask: Tensor) -> list:
        """x [batch, seq, proj] -> each layer's [batch, seq, 2 * proj] (forward half first)."""
        fwd = bwd = x
        layers = []
        for index, (f_layer, b_layer) in enumerate(zip(self.forward_layers, self.backward_layers)):
            if self.gradient_checkpointing and self.training:
                f_out = self._gradient_checkpointing_func(f_layer, fwd, mask)
                b_out = self._gradient_checkpointing_func(b_layer, bwd, mask)
            else:
                f_out, b_out = f_layer(fwd, mask), b_layer(bwd, mask)
            if index > 0 and self.skip:
                f_out, b_out = f_out + fwd, b_out + bwd
            fwd, bwd = f_out, b_out
            layers.append(torch.cat([fwd, bwd], dim=-1))
        return layers


class ScalarMix(nn.Module):
    """gamma * sum_j softmax(s)_j h_j over the layers h_j, each optionally normalised over
    its unmasked elements first (AllenNLP's do_layer_norm)."""

    def __init__(self, n_layers: int, do_layer_norm: bool = False):
        super().__init__()
        self.do_layer_norm = do_layer_norm
        self.scalars = nn.Parameter(torch.zeros(n_layers))
        self.gamma = nn.Parameter(torch.ones(1))

    def forward(self, layers: Sequence[Tensor], mask: Tensor) -> Tensor:
        weights = torch.softmax(self.scalars, dim=0)
        if self.do_layer_norm:
            layers = [_masked_standardize(h, mask) for h in layers]
        return self.gamma * sum(w * h for w, h in zip(weights, layers))


def _masked_standardize(h: Tensor, mask: Tensor) -> Tensor:
    keep = mask[..., None].to(h.dtype)
    count = keep.sum() * h.shape[-1]
    mean = (h * keep).sum() / count
    variance = (((h - mean) * keep) ** 2).sum() / count
    return (h - mean) / torch.sqrt(variance + 1e-12)


# --- models --------------------------------------------------------------------------------------

@dataclass
class ElmoOutput(ModelOutput):
    """ELMo's vectors: last_hidden_state is the first representation; hidden_states the
    three layers (the word vectors twice, then each LSTM layer) without the sentence
    markers."""

    last_hidden_state: Optional[Tensor] = None  # [batch, seq, 2 * proj]
    representations: Optional[list] = None  # one [batch, seq, 2 * proj] per scalar mix
    hidden_states: Optional[tuple] = None
    mask: Optional[Tensor] = None  # bool [batch, seq], True = token


@dataclass
class ElmoBiLMOutput(ModelOutput):
    """The biLM's loss (with word_ids) and its three layers [batch, seq + 2, 2 * proj],
    the sentence markers included."""

    loss: Optional[Tensor] = None
    hidden_states: Optional[tuple] = None


class _BiLM(PreTrainedModel):
    """What ELMo and ElmoBiLM share: the character encoder and the biLSTM, and the init."""

    config_class = ElmoConfig
    base_model_prefix = "elmo"
    main_input_name = "char_ids"
    supports_gradient_checkpointing = True

    def __init__(self, config: ElmoConfig):
        super().__init__(config)
        self.char_encoder = CharacterEncoder(config)
        self.lstm = ElmoLstm(config)

    def _layers(self, char_ids: Tensor) -> tuple[list, Tensor]:
        """The three layers over the sentences with their markers, and its mask."""
        if not isinstance(char_ids, Tensor) or char_ids.dtype != torch.long:
            got = char_ids.dtype if isinstance(char_ids, Tensor) else type(char_ids).__name__
            raise TypeError(f"char_ids must be an int64 tensor [batch, seq, chars], got {got}")
        if char_ids.dim() != 3 or char_ids.shape[-1] != self.config.max_characters_per_token:
            raise ValueError(f"char_ids must have {self.config.max_characters_per_token} characters "
                             f"per token, got shape {tuple(char_ids.shape)}")
        if char_ids.numel() and not 0 <= int(char_ids.min()) <= int(char_ids.max()) < self.config.n_characters:
            raise ValueError(f"char_ids must be in [0, {self.config.n_characters}), got values in "
                             f"[{int(char_ids.min())}, {int(char_ids.max())}]")
        mask = (char_ids > 0).any(dim=-1)
        ids, marked = add_sentence_markers(char_ids, mask)
        words = self.char_encoder(ids)
        layers = self.lstm(words, marked)
        return [torch.cat([words, words], dim=-1) * marked[..., None], *layers], marked

    def _init_weights(self, module: nn.Module) -> None:
        """ELMo's init, which transformers runs on every module at construction and on the
        tensors a checkpoint lacks at loading (its init functions skip those loaded):
        torch's own for the layers, highway gates that start by carrying their input
        through, even mixes, a softmax of the projection's scale."""
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Embedding)):
            # Its init calls go through transformers' guarded ones here. An Embedding's
            # padding row is zeroed unguarded, but a loaded Embedding is not initialised.
            module.reset_parameters()
            # The gate's bias; checked here, as the slice would not carry a loaded tensor's mark.
            if isinstance(module, Highway) and not getattr(module.bias, "_is_hf_initialized", False):
                init.ones_(module.bias[module.in_features:])
        elif isinstance(module, ScalarMix):
            init.zeros_(module.scalars)
            init.ones_(module.gamma)
        elif isinstance(module, ElmoBiLM):
            init.normal_(module.softmax_weight, std=self.config.projection_dim ** -0.5)
            init.zeros_(module.softmax_bias)

    @classmethod
    def from_allennlp(cls, options_file, weight_file, **config_overrides):
        """The model of an AllenNLP options.json and weights.hdf5 (bilm-tf's layout); parts
        the file does not hold (the mixes, a softmax) keep their initial values."""
        import h5py

        with open(options_file) as f:
            options = json.load(f)
        with h5py.File(weight_file, "r") as weights:
            rows = weights["char_embed"].shape[0] + 1  # plus the padding row
            config = ElmoConfig.from_options(options, **{"n_characters": rows, **config_overrides})
            model = cls(config)  # initialised here, so the file's weights are kept
            state = model.state_dict()
            state.update(_read_hdf5(weights, config))
        model.load_state_dict(state)
        return model


class ELMo(_BiLM):
    """Contextual word vectors: ``model(batch_to_ids(sentences)).representations``."""

    def __init__(self, config: ElmoConfig):
        super().__init__(config)
        self.mixes = nn.ModuleList(ScalarMix(config.n_layers + 1, config.do_layer_norm)
                                   for _ in range(config.num_output_representations))
        self.dropout = nn.Dropout(config.dropout)
        self.post_init()

    def forward(self, char_ids: Tensor) -> ElmoOutput:
        layers, marked = self._layers(char_ids)
        mask = marked[:, 2:]  # the tokens, in their positions without the markers
        keep = mask[..., None]

        def unmark(h):
            return h[:, 1:-1] * keep

        representations = [self.dropout(unmark(mix(layers, marked))) for mix in self.mixes]
        return ElmoOutput(last_hidden_state=representations[0], representations=representations,
                          hidden_states=tuple(unmark(h) for h in layers), mask=mask)

    def embed(self, sentences: Union[Sequence[Sequence[str]], Tensor]) -> Tensor:
        """[batch, seq, 2 * projection_dim] vectors of tokenized sentences (or character
        ids), from the first mix."""
        if not isinstance(sentences, Tensor):
            sentences = batch_to_ids(sentences, self.config.max_characters_per_token).to(self.device)
        return self(sentences).last_hidden_state


class ElmoBiLM(_BiLM):
    """The bidirectional language model ELMo is trained as: a softmax over
    ``config.vocab_size`` words, shared by the two directions, on the top layer."""

    def __init__(self, config: ElmoConfig):
        if config.vocab_size < 1:
            raise ValueError(f"config.vocab_size must be at least 1 for ElmoBiLM, got {config.vocab_size}")
        super().__init__(config)
        self.softmax_weight = nn.Parameter(torch.empty(config.vocab_size, config.projection_dim))
        self.softmax_bias = nn.Parameter(torch.empty(config.vocab_size))
        self.post_init()

    def forward(self, char_ids: Tensor, word_ids: Optional[Tensor] = None) -> ElmoBiLMOutput:
        """word_ids [batch, seq]: the words' ids (-100, and positions past a sentence's end,
        are ignored). Returns the mean of the two directions' losses and the layers."""
        layers, marked = self._layers(char_ids)
        if word_ids is None:
            return ElmoBiLMOutput(hidden_states=tuple(layers))
        if word_ids.shape != char_ids.shape[:2]:
            raise ValueError(f"word_ids must have shape {tuple(char_ids.shape[:2])}, got "
                             f"{tuple(word_ids.shape)}")
        proj = self.config.projection_dim
        top = layers[-1]
        labels = F.pad(word_ids.masked_fill(~marked[:, 2:], -100), (1, 1), value=-100)
        # Position p (markers included) predicts the word at p + 1 forwards, at p - 1 backwards.
        ahead = F.pad(labels[:, 1:], (0, 1), value=-100)
        behind = F.pad(labels[:, :-1], (1, 0), value=-100)
        losses = [ops.masked_lm_loss(top[..., half], self.softmax_weight.to(top.dtype),
                                     self.softmax_bias.to(top.dtype), target)
                  for half, target in ((slice(0, proj), ahead), (slice(proj, None), behind))]
        return ElmoBiLMOutput(loss=(losses[0] + losses[1]) / 2, hidden_states=tuple(layers))


# --- AllenNLP's weights.hdf5 ---------------------------------------------------------------------

def _read_hdf5(weights, config: ElmoConfig) -> dict:
    """Our state_dict entries from bilm-tf's datasets (TensorFlow computes x @ W, so every
    matrix is transposed; its LSTM gates are ordered i, j, f, o and it adds 1 to the forget
    bias at run time; its highway gate carries the transform, AllenNLP's the input)."""
    def t(name, shape=None):
        if name not in weights:
            raise ValueError(f"the weight file has no dataset {name}")
        if shape is not None and tuple(weights[name].shape) != tuple(shape):
            raise ValueError(f"{name} in the weight file has shape {tuple(weights[name].shape)}, "
                             f"but the options ask for {tuple(shape)}")
        return torch.from_numpy(weights[name][...]).float()

    dim, n = config.char_embedding_dim, sum(channels for _, channels in config.filters)
    cell, size = config.lstm_dim, config.projection_dim
    state = {}
    embed = t("char_embed", (config.n_characters - 1, dim))
    state["char_encoder.embedding.weight"] = torch.cat([embed.new_zeros(1, embed.shape[1]), embed])
    for i, (width, channels) in enumerate(config.filters):
        # [1, width, in, out] -> Conv1d's [out, in, width]
        kernel = t(f"CNN/W_cnn_{i}", (1, width, dim, channels))
        state[f"char_encoder.convs.{i}.weight"] = kernel[0].permute(2, 1, 0)
        state[f"char_encoder.convs.{i}.bias"] = t(f"CNN/b_cnn_{i}", (channels,))
    for k in range(config.n_highway):
        high = f"CNN_high_{k}"
        state[f"char_encoder.highways.{k}.weight"] = torch.cat(
            [t(f"{high}/W_transform", (n, n)).t(), -t(f"{high}/W_carry", (n, n)).t()])
        state[f"char_encoder.highways.{k}.bias"] = torch.cat(
            [t(f"{high}/b_transform", (n,)), -t(f"{high}/b_carry", (n,))])
    state["char_encoder.projection.weight"] = t("CNN_proj/W_proj", (n, size)).t()
    state["char_encoder.projection.bias"] = t("CNN_proj/b_proj", (size,))

    order = torch.cat([torch.arange(cell), torch.arange(2 * cell, 3 * cell),
                       torch.arange(cell, 2 * cell), torch.arange(3 * cell, 4 * cell)])
    for direction, name in enumerate(("forward_layers", "backward_layers")):
        for layer in range(config.n_layers):
            cell_path = f"RNN_{direction}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"
            w = t(f"{cell_path}/W_0", (2 * size, 4 * cell)).t()[order]  # [4 cell, input + proj], gates i, f, j, o
            bias = t(f"{cell_path}/B", (4 * cell,))
            bias[2 * cell:3 * cell] += 1.0  # TensorFlow's forget bias
            prefix = f"lstm.{name}.{layer}"
            state[f"{prefix}.input_linearity.weight"] = w[:, :size].contiguous()
            state[f"{prefix}.state_linearity.weight"] = w[:, size:].contiguous()
            state[f"{prefix}.state_linearity.bias"] = bias[order]
            state[f"{prefix}.state_projection.weight"] = t(f"{cell_path}/W_P_0", (cell, size)).t().contiguous()
    return state
