"""poseidon_aio: Poseidon (WFBP + HybComm) and MG-WFBP data-parallel training for PyTorch on an
asyncio core.

    import poseidon_aio

    async def main():
        async with poseidon_aio.Trainer(model, optimizer, loss_fn) as trainer:
            for batch in loader:
                stats = await trainer.step(batch)

    poseidon_aio.run(main())

The heavy parts load on first use, so ``import poseidon_aio.wire`` stays free of asyncio and torch.
"""

__version__ = "0.1.0"

_LAZY = {
    "Trainer": ("poseidon_aio.train", "Trainer"),
    "StepStats": ("poseidon_aio.train", "StepStats"),
    "PSConfig": ("poseidon_aio.ps", "PSConfig"),
    "StragglerPolicy": ("poseidon_aio.ps", "StragglerPolicy"),
    "ServerSGD": ("poseidon_aio.ps", "ServerSGD"),
    "NetConfig": ("poseidon_aio.net", "NetConfig"),
    "TLSConfig": ("poseidon_aio.net", "TLSConfig"),
    "ShaperConfig": ("poseidon_aio.net", "ShaperConfig"),
    "StartupConfig": ("poseidon_aio.cluster", "StartupConfig"),
    "MergeConfig": ("poseidon_aio.plan", "MergeConfig"),
    "AllReduceConfig": ("poseidon_aio.sync", "AllReduceConfig"),
    "CompressionConfig": ("poseidon_aio.plan", "CompressionConfig"),
    "OptimizerConfig": ("poseidon_aio.train", "OptimizerConfig"),
    "TraceConfig": ("poseidon_aio.train", "TraceConfig"),
    "run": ("poseidon_aio.net", "run"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'poseidon_aio' has no attribute {name!r}")
