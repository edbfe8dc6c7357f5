"""A micro-batch's loss as the step differentiates it: the stage's objective (the language
model's cross entropy, a preference or reward loss, GRPO's), scaled by the loss scaler, plus what
joins the gradient but not the reported loss (the MoE routers' losses, and multi-token
prediction's on the last pipeline stage), for the whole model or one pipeline chunk."""

from __future__ import annotations

from mindspeed_core.models.moe import with_router_losses


class StepLoss:
    """``objective``: the stage's (training/alignment.py, training/grpo.py), or None for the
    language-modelling loss; ``scaler``: the run's LossScaler; ``chunk``: --loss-compute-mode
    chunk's --loss-chunk-size (the language-modelling loss's output layer a chunk of positions at
    a time), or None."""

    def __init__(self, objective, scaler, chunk: int | None = None):
        self.objective, self.scaler = objective, scaler
        self.chunk = chunk if objective is None else None

    def __call__(self, model, out, labels, tokens=None):
        """The micro-batch's loss from the model's output, unscaled (what is reported)."""
        if self.objective is not None:
            return self.objective(model, out, labels, tokens)
        if self.chunk is not None:  # ``out``: the final norm's output (forward_for_loss)
            return model.chunked_loss(out, labels, tokens, self.chunk)
        return model.loss_from_logits(out, labels, tokens)

    def forward_for_loss(self, model, x, tokens=None):
        """The last stage's output that __call__ takes: the logits, or with a chunk the final
        norm's output (the head applied chunk by chunk)."""
        return model(x, tokens) if self.chunk is None else model(x, tokens, logits=False)

    def of_model(self, model):
        """fn(ids, labels, tokens) -> the scaled loss of the whole ``model``, what its gradient is taken of."""
        def loss(ids, labels, tokens=None):
            out = self.scaler.scale_loss(self(model, self.forward_for_loss(model, ids, tokens), labels, tokens))
            return self.with_extra_losses(model, out, labels, tokens)

        return loss

    def of_chunk(self, chunks: list, scaled: bool = True):
        """fn(chunk, x, labels, tokens) for the pipeline: one model chunk's output, and with labels
        (the last stage) the loss, scaled for training (``scaled``) or as reported."""
        def forward(chunk: int, x, labels, tokens=None):
            model = chunks[chunk]
            out = model(x, tokens) if labels is None else self.forward_for_loss(model, x, tokens)
            if labels is not None:
                out = self(model, out, labels, tokens)
            if not scaled:
                return out
            if labels is not None:
                out = self.scaler.scale_loss(out)
            return self.with_extra_losses(model, out, labels, tokens)

        return forward

    def of_compiled_chunk(self, chunks: list):
        """of_chunk as --compile runs it: the loss scale is a tensor input (a compiler would freeze
        a number); no packed sequences, MoE or multi-token prediction (refused)."""
        def forward(chunk: int, x, labels=None, scale=None):
            model = chunks[chunk]
            out = model(x)
            return out if labels is None else self(model, out, labels, None) * scale

        return forward

    def with_extra_losses(self, model, out, labels=None, tokens=None, routers=None):
        """What joins the gradient but not the reported loss, scaled as the loss, through the
        chunk's output (an activation or the loss: models/moe.py with_router_losses): the MoE
        routers' losses (``routers``: of these MoE layers only; default all), sparse attention's
        indexer losses, and on the last stage multi-token prediction's."""
        extra = None
        if labels is not None and hasattr(model, "mtp"):  # first: its MoE layers route in it
            extra = model.mtp_loss(labels, tokens)
        routers = getattr(model, "moe_layers", list)() if routers is None else routers
        if routers:
            extra = model.router_losses(routers) if extra is None else extra + model.router_losses(routers)
        indexers = model.indexer_losses() if model.cfg.dsa is not None else None  # after MTP's: its layers index
        if indexers is not None:
            extra = indexers if extra is None else extra + indexers
        if extra is None:
            return out
        return with_router_losses(out, self.scaler.scale_loss(extra))
