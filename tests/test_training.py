"""Training LambdaResNets through timm's own API, and one DistributedDataParallel step."""
import os
import socket

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image
from timm.data import create_dataset, create_loader, resolve_data_config
from timm.optim import create_optimizer_v2

import timm_lambda  # noqa: F401  (registers the models)


def _write_image_folder(root, classes=2, per_class=8, size=48, seed=0):
    """Two visually separable classes: mostly-red vs mostly-blue noisy images."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = root / f'class{c}'
        folder.mkdir(parents=True)
        for i in range(per_class):
            img = rng.integers(0, 80, size=(size, size, 3), dtype=np.uint8)
            img[..., 0 if c == 0 else 2] += 150
            Image.fromarray(img).save(folder / f'{i}.png')
    return root


def test_short_training_run_lowers_the_loss(tmp_path):
    torch.manual_seed(0)
    root = _write_image_folder(tmp_path / 'train')
    model = timm.create_model('lambdaresnet50', num_classes=2, drop_rate=0.0)
    data_config = resolve_data_config({'input_size': (3, 48, 48)}, model=model)
    dataset = create_dataset('', root=str(root), split='train', is_training=True)
    loader = create_loader(dataset, input_size=data_config['input_size'], batch_size=8, is_training=True,
                           no_aug=True, mean=data_config['mean'], std=data_config['std'], num_workers=0,
                           persistent_workers=False,  # needed with no workers before timm 1.0.29
                           interpolation=data_config['interpolation'], use_prefetcher=False,
                           device=torch.device('cpu'))
    optimizer = create_optimizer_v2(model, opt='adamw', lr=2e-3, weight_decay=0.0)
    loss_fn = torch.nn.CrossEntropyLoss()

    def epoch_loss(train: bool) -> float:
        model.train(train)
        total = 0.0
        for x, y in loader:
            with torch.set_grad_enabled(train):
                loss = loss_fn(model(x), y)
            if train:
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            total += loss.item()
        return total / len(loader)

    first = epoch_loss(True)
    for _ in range(5):
        last = epoch_loss(True)
    assert np.isfinite(last)
    assert last < 0.5 * first, (first, last)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, out_dir: str):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    dist.init_process_group('gloo', rank=rank, world_size=world)
    torch.manual_seed(0)  # identical initial weights on both ranks
    model = timm.create_model('lambdaresnet50', num_classes=3)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    torch.manual_seed(100 + rank)  # different data per rank
    for _ in range(2):  # an unused parameter makes the second iteration raise
        x, y = torch.randn(2, 3, 64, 64), torch.randint(0, 3, (2,))
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, missing
        opt.step()
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
    gathered = [torch.zeros_like(checksum) for _ in range(world)]
    dist.all_gather(gathered, checksum)
    torch.save(torch.cat(gathered), os.path.join(out_dir, f'rank{rank}.pt'))
    dist.destroy_process_group()


def test_ddp_two_cpu_processes_no_unused_parameters(tmp_path):
    mp.spawn(_ddp_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    sums = torch.load(tmp_path / 'rank0.pt')
    # gradients were averaged, so both replicas hold identical weights after the steps
    assert torch.equal(sums, torch.load(tmp_path / 'rank1.pt'))
    assert sums[0] == sums[1]
