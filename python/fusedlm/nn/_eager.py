"""fusedlm's modules run eagerly or under torch.compile, not as TorchScript.

Their forwards call fusedlm's ops through Python dispatch (backend choice, checks at
first use), which TorchScript cannot compile. torch.jit.script prepares every module
it is given, and each submodule, with ``__prepare_scriptable__``: there it gets an
error saying so, instead of a compiler error from deep inside a forward.
"""


class EagerModule:
    """Mixed into each fusedlm.nn module, before its torch.nn base."""

    def __prepare_scriptable__(self):
        name = type(self).__name__
        raise TypeError(f"fusedlm.nn.{name} cannot be scripted: fusedlm's modules run eagerly "
                        f"or under torch.compile, not as TorchScript (torch.jit.script). "
                        f"Use torch.compile instead, or script a model built of torch.nn's modules")
