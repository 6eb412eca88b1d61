"""The bundled examples' options, declared without torch: each a flag with a TRAINPOD_* twin (trainpod.settings).

The examples parse them in their ranks (trainpod.examples.harness); the launcher parses the same declarations before
anything starts (Example.check_args), so that a typo in an example's flag is one line on every node at once, not a
rank's error after the nodes met. What needs torch to tell (nccl without CUDA) stays the ranks' to say.
"""

from __future__ import annotations

from trainpod.contract import CHECKPOINT_DIR_VAR, OUTPUT_DIR_VAR, WORKERS_VAR
from trainpod.settings import BACKEND, Boolean, Choice, Integer, Number, Setting

DATA_DIR_VAR = "TRAINPOD_DATA_DIR"
SYNTHETIC_SAMPLES_VAR = "TRAINPOD_SYNTHETIC_SAMPLES"
OPTIMIZERS = ("sgd", "adam")  # trainpod.examples.precision builds them
AMP_DTYPES = ("auto", "bfloat16", "float16")  # what --amp computes in (precision.DTYPES)
APEX_CHOICES = ("auto", "on", "off")
ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101")  # torchvision's names (trainpod.examples.resnet.ARCHS)
RESNET_WIDTH = 64  # torchvision's first stage (resnet.WIDTH)

# The options every example has. An example changes their defaults with Recipe.defaults.
COMMON = (
    Setting("output_dir", "where rank 0 writes metrics.json", var=OUTPUT_DIR_VAR, default="./output", metavar="DIR"),
    Setting("epochs", "epochs", Integer(1, 100_000), var="TRAINPOD_EPOCHS", default=2),
    Setting("batch_size", "batch size per process", Integer(1, 1 << 20), var="TRAINPOD_BATCH_SIZE", default=64),
    Setting("lr", "peak learning rate (linear warm-up, then cosine decay)", Number(above=0, unit=""), var="TRAINPOD_LR",
            default=0.1),
    Setting("optimizer", "sgd (momentum 0.9) or adam", Choice(OPTIMIZERS), var="TRAINPOD_OPTIMIZER", default="sgd"),
    Setting("seed", "seed for weights, data order, augmentation and synthetic data", Integer(0, 2**32 - 1),
            var="TRAINPOD_SEED", default=0),
    Setting("backend", "gloo (CPU) or nccl (GPU LOCAL_RANK); default nccl where CUDA is", BACKEND.kind, var=BACKEND.var),
    Setting("workers", "DataLoader worker processes per process (default: the example's)", Integer(0, 256),
            var=WORKERS_VAR),
    Setting("max_steps", "stop after this many steps", Integer(1), var="TRAINPOD_MAX_STEPS"),
    Setting("log_every", "steps between loss log points", Integer(1), var="TRAINPOD_LOG_EVERY", default=10),
    Setting("tensorboard", "rank 0 writes TensorBoard scalars here: loss, samples/s, LR, world size, test accuracy",
            var="TRAINPOD_TENSORBOARD", metavar="DIR"),
    Setting("checkpoint_dir", "save checkpoints here and resume from the newest; shared by all nodes (rank 0 writes)",
            var=CHECKPOINT_DIR_VAR, metavar="DIR"),
    Setting("checkpoint_every", "steps between checkpoints", Integer(1), var="TRAINPOD_CHECKPOINT_EVERY", default=10),
    Setting("keep", "checkpoints kept", Integer(1, 10_000), var="TRAINPOD_CHECKPOINT_KEEP", default=3),
    Setting("amp", "mixed precision: autocast to bfloat16 on CPU, float16 with a grad scaler on CUDA", Boolean(),
            var="TRAINPOD_AMP", default=False),
    Setting("amp_dtype", "what --amp computes in: auto (bfloat16 on CPU, float16 on CUDA), bfloat16, float16",
            Choice(AMP_DTYPES), var="TRAINPOD_AMP_DTYPE", default="auto"),
)


# The data-loading examples': each declares its own help and default.
CIFAR = (
    Setting("data_dir", "directory with cifar-10-batches-py/ or the batch files; else synthetic data",
            var=DATA_DIR_VAR, metavar="DIR"),
    Setting("synthetic_samples", "synthetic training samples", Integer(1, 1 << 24), var=SYNTHETIC_SAMPLES_VAR,
            default=4096),
)

CIFAR_AMP = (*CIFAR, Setting("apex", "use Apex's fused optimizer and LayerNorm: auto (where Apex imports and CUDA runs), "
                             "on, off", Choice(APEX_CHOICES), var="TRAINPOD_APEX", default="auto"))

IMAGENET = (
    Setting("arch", "the ResNet, by torchvision's name", Choice(ARCHS), var="TRAINPOD_ARCH", default="resnet50"),
    Setting("width", "channels of the ResNet's first stage, doubled at each later one (torchvision's: 64; smaller for quick "
            "runs and tests: 8 has about 1/60 of the parameters)", Integer(1, 1024), var="TRAINPOD_RESNET_WIDTH", default=RESNET_WIDTH),
    Setting("data_dir", "ImageFolder tree of JPEGs: train/ and val/ with one directory per class (or one split); "
            "else synthetic data", var=DATA_DIR_VAR, metavar="DIR"),
    Setting("image_size", "side of the training crops in pixels (224 for ImageNet; small for quick runs)", Integer(16, 1024),
            var="TRAINPOD_IMAGE_SIZE", default=224),
    Setting("synthetic_samples", "synthetic training samples (held in memory: N x 3 x S x S bytes)", Integer(1, 1 << 22),
            var=SYNTHETIC_SAMPLES_VAR, default=1024),
    Setting("synthetic_classes", "classes of the synthetic set", Integer(2, 1000), var="TRAINPOD_SYNTHETIC_CLASSES", default=100),
)
