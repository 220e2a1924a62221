"""The field's classic training bugs as named mutants of this tree, and a check that the tests
catch each one.

    python tests/mutants.py                  # every mutant: a table, exit status 1 if any survives
    python tests/mutants.py --only NAME ...  # just those
    python tests/mutants.py --list           # each mutant's bug, and the tests that should fail

A mutant is a small edit that puts one classic bug where it would really live (a line left out,
a wrong argument).  For each, the tree is copied to a scratch folder (the files git tracks or
would track: no .venv, runs/ or data/), the edit is applied there, and `python -m pytest -x -q`
runs the mutant's tests in that copy with this interpreter.  "killed": a test failed, as it
should; "survived": they all passed -- the suite cannot tell the bug from the real thing;
"error": the edit no longer applies (its original text is not found exactly once: the mutant is
stale and must be updated with the code), or the tests timed out or could not run.  First, the
same tests run once on an unmutated copy: a failure there would pass for a kill, so the run
stops (exit status 2).  The working tree is never changed.  Its 91 mutants take about
20 minutes on 2 cores.
"""
import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUGS = "tests/test_classic_bugs.py::"


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository root
    original: str  # must occur exactly once in the file
    replacement: str
    tests: tuple  # pytest arguments: node ids, or a file with "-k", EXPRESSION
    bug: str
    timeout: int = 600  # seconds for its tests


def replay(main):
    return BUGS + f"test_every_sgd_step_uses_its_own_batch_and_the_per_step_schedule[{main}]"


SYNC_END_TO_END = BUGS + "test_sync_sgd_logs_the_accuracy_of_the_model_it_saves[2]"
SYNC_END_TO_END_3 = BUGS + "test_sync_sgd_logs_the_accuracy_of_the_model_it_saves[3]"
EVALUATION = BUGS + ("test_evaluation_is_the_same_at_every_test_batch_size_and_leaves_the_"
                     "model_alone")
RESUME = "tests/test_scripts.py::test_resume_continues_where_it_stopped"
ASYNC_RESUME = ("tests/test_distributed_faults.py::test_async_sgd_stopped_inside_an_epoch_trains_"
                "each_batch_of_it_once")
RULE = BUGS + "test_async_server_applies_its_rule_to_stale_gradients"
SCALE = "tests/test_scale.py::"
RESUMED_BATCHES = ("tests/test_data.py::test_a_resumed_epoch_draws_each_batchs_crops_flips_and_"
                   "dropout_masks_again")
STOPPED_INSIDE_AN_EPOCH = ("tests/test_reliability.py::test_a_run_stopped_inside_an_epoch_ends_"
                           "as_the_uninterrupted_one_dropout_and_all")
SYNC_STOPPED_INSIDE_AN_EPOCH = ("tests/test_reliability.py::test_sync_sgd_stopped_inside_an_epoch_"
                                "ends_as_the_uninterrupted_run")

MUTANTS = [
    # ------------------------------------------------------------------------- evaluation
    Mutant("eval-without-model-eval", "common/training.py",
           "    model.eval()\n", "",
           (EVALUATION,),
           "evaluation in training mode: BatchNorm uses batch statistics (and updates its "
           "running ones), dropout stays on"),
    Mutant("eval-without-no-grad", "common/training.py",
           "@torch.no_grad()\ndef evaluate(", "def evaluate(",
           (BUGS + "test_evaluation_builds_no_autograd_graph",),
           "evaluation builds an autograd graph (the memory of a backward pass, for nothing)"),
    Mutant("accuracy-averaged-over-batches", "common/training.py",
           '        totals[0] += F.cross_entropy(output.float(), labels, reduction="sum")\n'
           "        totals[1] += (output.argmax(1) == labels).sum()\n"
           "        totals[2] += labels.numel()\n",
           "        totals[0] += F.cross_entropy(output.float(), labels)\n"
           "        totals[1] += (output.argmax(1) == labels).float().mean()\n"
           "        totals[2] += 1\n",
           (EVALUATION,),
           "test loss and accuracy are means of per-batch means: a short last batch weighs "
           "as much as a full one"),
    Mutant("label-smoothing-on-the-test-loss", "common/training.py",
           'F.cross_entropy(output.float(), labels, reduction="sum")',
           'F.cross_entropy(output.float(), labels, reduction="sum", label_smoothing=0.1)',
           (EVALUATION,),
           "the test loss is label-smoothed (not the plain cross-entropy anyone compares)"),
    # ------------------------------------------------------------------- the data's order
    Mutant("set-epoch-never-called", "common/loader.py",
           "        self.set_epoch(epoch)\n", "",
           (BUGS + "test_each_epoch_visits_every_sample_once_in_a_new_order",
            BUGS + "test_async_worker_visits_its_shard_in_a_new_order_each_epoch"),
           "the training loops never set the epoch: every epoch the same order and crops"),
    Mutant("sampler-seeded-per-rank", "common/loader.py",
           "shuffle=True, seed=seed)", "shuffle=True, seed=seed + rank)",
           ("tests/test_data.py::test_train_sampler_shards_cover_each_sample_once_per_epoch",),
           "each rank shuffles with its own seed: the shards overlap and miss samples"),
    Mutant("one-crop-per-batch", "common/loader.py",
           "    dy = torch.randint(0, 2 * pad + 1, (b, 1), device=dev, generator=gen)\n"
           "    dx = torch.randint(0, 2 * pad + 1, (b, 1), device=dev, generator=gen)\n"
           "    flip = torch.rand((b, 1), device=dev, generator=gen) < 0.5\n",
           "    dy = torch.randint(0, 2 * pad + 1, (1, 1), device=dev, generator=gen)"
           ".expand(b, 1)\n"
           "    dx = torch.randint(0, 2 * pad + 1, (1, 1), device=dev, generator=gen)"
           ".expand(b, 1)\n"
           "    flip = (torch.rand((1, 1), device=dev, generator=gen) < 0.5).expand(b, 1)\n",
           ("tests/test_data.py::test_augmentation_is_random_zero_padded_crop_and_flip",),
           "one crop and one flip drawn per batch, not per image"),
    Mutant("training-images-not-augmented", "common/loader.py",
           "self.augment = train if augment is None else augment",
           "self.augment = False if augment is None else augment",
           ("tests/test_data.py::test_augmentation_is_random_zero_padded_crop_and_flip",),
           "no random crop or flip on the training images"),
    Mutant("dropout-not-reseeded-per-batch", "common/loader.py",
           "            torch.manual_seed(self.seed_for(k, self.DROPOUT))  # the masks its forward "
           "pass draws\n", "",
           (RESUME, RESUMED_BATCHES + "[none-in-memory]"),
           "dropout masks continue the process's stream: a resumed run is not the "
           "uninterrupted one"),
    Mutant("dropout-seeded-once-per-epoch", "common/loader.py",
           "        for k, batch in enumerate(self.batches(start), start):\n"
           "            torch.manual_seed(self.seed_for(k, self.DROPOUT))  # the masks its forward "
           "pass draws\n            yield batch\n",
           "        torch.manual_seed(self.seed_for(start, self.DROPOUT))\n"
           "        yield from self.batches(start)\n",
           (RESUMED_BATCHES + "[none-in-memory]", STOPPED_INSIDE_AN_EPOCH),
           "dropout seeded once per epoch, at the batch it starts from: a run stopped inside an "
           "epoch resumes with other masks for every later batch"),
    Mutant("image-folder-augmented-from-each-process-stream", "common/loader.py",
           "        torch.manual_seed(key[0])\n", "",
           (RESUMED_BATCHES + "[none-image-folder]",),
           "an image folder's crops and flips come from the stream of whichever decoding "
           "process gets the sample: a resumed epoch draws others"),
    Mutant("trivial-augment-from-the-process-stream", "common/loader.py",
           "                torch.manual_seed(self.seed_for(k, self.AUGMENT))\n", "",
           (RESUMED_BATCHES + "[ta_wide-in-memory]",),
           "TrivialAugment draws from wherever the process's generator stands: a resumed epoch "
           "augments its batches otherwise"),
    Mutant("trivial-augment-on-test-batches", "common/loader.py",
           'if self.augment and auto_augment == "ta_wide":',
           'if auto_augment == "ta_wide":',
           ("tests/test_data.py::test_test_batches_not_augmented_and_normalised",
            "tests/test_data.py::test_auto_augment_flag_reaches_the_training_batches_only"),
           "TrivialAugment applied to the test images too: the test accuracy of altered images"),
    Mutant("auto-augment-flag-ignored", "common/loader.py",
           "auto_augment=args.auto_augment, ", "",
           ("tests/test_data.py::test_auto_augment_flag_reaches_the_training_batches_only",),
           "--auto-augment is parsed but never reaches the loader"),
    # ------------------------------------------------------------------ data and labels
    Mutant("cifar-coarse-labels", "common/cifar.py",
           'batch.get(b"fine_labels")', 'batch.get(b"coarse_labels")',
           ("tests/test_data.py::test_cifar_loader_shapes_labels_classes",),
           "CIFAR-100's 20 coarse labels instead of the 100 fine ones"),
    Mutant("cifar-reshaped-as-hwc", "common/cifar.py",
           "torch.from_numpy(data.reshape(-1, 3, 32, 32).copy())",
           "torch.from_numpy(data.reshape(-1, 32, 32, 3).copy()).permute(0, 3, 1, 2)",
           ("tests/test_data.py::test_cifar_loader_shapes_labels_classes",),
           "the channel-planar rows read as height x width x channel (the classic transpose "
           "mistake)"),
    Mutant("tiny-val-labels-in-wnids-order", "common/images.py",
           '            val.append((os.path.join(root, "val", "images", fields[0]), '
           "index[fields[1]]))\n",
           '            val.append((os.path.join(root, "val", "images", fields[0]), '
           "open(wnids_path).read().split().index(fields[1])))\n",
           ("tests/test_data.py::test_tiny_val_split_matches_annotations",),
           "TinyImageNet validation labels numbered in wnids.txt's order, training folders "
           "in sorted order"),
    Mutant("test-images-augmented", "common/loader.py",
           "self.augment = train if augment is None else augment",
           "self.augment = True if augment is None else augment",
           ("tests/test_data.py::test_test_batches_not_augmented_and_normalised",),
           "random crops and flips applied to the test images too"),
    Mutant("test-set-other-statistics", "common/loader.py",
           "    mean, std = normalization(args.dataset, pretrained)\n",
           "    mean, std = normalization(args.dataset, pretrained or not train)\n",
           (BUGS + "test_training_and_test_batches_are_normalised_alike",),
           "the test set normalised with ImageNet's mean and std, the training set with its "
           "own"),
    Mutant("imagenet-weights-get-dataset-statistics", "common/loader.py",
           "    if pretrained or dataset not in SPECS:\n",
           "    if dataset not in SPECS:\n",
           (BUGS + "test_training_and_test_batches_are_normalised_alike[imagenet-weights]",),
           "the loaders normalise with the data set's statistics even for ImageNet weights"),
    Mutant("pretrained-fed-cifar-statistics", "pretrained_cifar100.py",
           "train=True, pretrained=True)\n    test_loader = make_loader(test_set, args, run, "
           "train=False, pretrained=True)\n", "train=True, pretrained=False)\n    test_loader = "
           "make_loader(test_set, args, run, train=False, pretrained=False)\n",
           (BUGS + "test_pretrained_script_feeds_imagenet_normalised_images",),
           "ImageNet weights fed images normalised with CIFAR-100's statistics"),
    # ------------------------------------------------------------------- the SGD step
    Mutant("zero-grad-missing", "resnet_cifar100.py",
           "        optimizer.zero_grad(set_to_none=True)\n", "",
           (replay("resnet_cifar100"),),
           "gradients accumulate over every step of the run"),
    Mutant("sync-zero-grad-missing", "sync_sgd_cifar100.py",
           "        optimizer.zero_grad(set_to_none=True)\n", "",
           (replay("sync_sgd_cifar100"),),
           "sync SGD: gradients accumulate over every step"),
    Mutant("lr-stepped-per-epoch", "resnet_cifar100.py",
           "        scheduler.step()  # the learning rate changes every step\n"
           "        metrics.update(loss, output, labels)\n",
           "        metrics.update(loss, output, labels)\n"
           "        if metrics.step == len(train_loader):\n"
           "            scheduler.step()  # once per epoch\n",
           (replay("resnet_cifar100"),),
           "the per-step schedule stepped once per epoch: the warm-up lasts for ever"),
    Mutant("lr-never-stepped", "resnet_cifar100.py",
           "        scheduler.step()  # the learning rate changes every step\n", "",
           (replay("resnet_cifar100"),),
           "the schedule is never stepped: the whole run at the first warm-up step's LR"),
    Mutant("tinyimagenet-lr-never-stepped", "resnet_tinyimagenet.py",
           "        scheduler.step()  # the learning rate changes every step\n", "",
           (replay("resnet_tinyimagenet"),),
           "resnet_tinyimagenet.py never steps its schedule"),
    Mutant("pretrained-zero-grad-missing", "pretrained_cifar100.py",
           "        optimizer.zero_grad(set_to_none=True)\n", "",
           (replay("pretrained_cifar100"),),
           "fine-tuning: gradients accumulate over every step"),
    Mutant("weight-decay-on-batchnorm-and-biases", "common/training.py",
           '[p for p in params if p.ndim <= 1], "weight_decay": 0.0}',
           '[p for p in params if p.ndim <= 1], "weight_decay": weight_decay}',
           (BUGS + "test_weight_decay_shrinks_conv_and_linear_weights_only",),
           "weight decay pulls BatchNorm scales and all biases towards 0"),
    Mutant("weight-decay-never-applied", "common/training.py",
           '[p for p in params if p.ndim > 1], "weight_decay": weight_decay}',
           '[p for p in params if p.ndim > 1], "weight_decay": 0.0}',
           (BUGS + "test_weight_decay_shrinks_conv_and_linear_weights_only",),
           "--weight-decay is ignored: no parameter group decays"),
    # ------------------------------------------------------------------------- resume
    Mutant("resume-without-momentum", "common/checkpoint.py",
           '        optimizer.load_state_dict(state["optimizer"])\n',
           "        pass\n",
           (RESUME,),
           "a resumed run starts with empty momentum buffers"),
    Mutant("resume-without-schedule", "common/checkpoint.py",
           '        scheduler.load_state_dict(state["scheduler"])\n',
           "        pass\n",
           (RESUME,),
           "a resumed run starts the LR schedule (warm-up) again"),
    # ----------------------------------------------------------------------- sync SGD
    Mutant("sync-every-rank-trains-on-everything", "sync_sgd_cifar100.py",
           "batch_size=args.batch_size // world, **shard)",
           "batch_size=args.batch_size // world, rank=0, world_size=1)",
           (SYNC_END_TO_END,),
           "no sharding: each rank trains on the whole data set, an epoch is world x too long"),
    Mutant("sync-sums-gradients", "sync_sgd_cifar100.py",
           "    flat /= world_size\n", "",
           ("tests/test_distributed.py::"
            "test_sync_sgd_on_two_ranks_equals_one_process_with_the_global_batch",),
           "gradients summed over ranks, not averaged (the LR x world size)"),
    Mutant("sync-gradients-never-averaged", "sync_sgd_cifar100.py",
           "        average_gradients(model, comm.world_size)",
           "        pass",
           (SYNC_END_TO_END,),
           "each rank steps on its own gradient: the replicas drift apart"),
    Mutant("sync-no-initial-broadcast", "sync_sgd_cifar100.py",
           "        comm.broadcast_parameters(model)  # 1. every rank starts from rank 0's "
           "weights\n", "",
           (SYNC_END_TO_END,),
           "ranks start from their own random weights (seed + rank) and never agree"),
    Mutant("sync-batchnorm-not-averaged", "sync_sgd_cifar100.py",
           "                comm.average_buffers(model)  # BatchNorm statistics: one model, the "
           "one saved\n", "",
           (SYNC_END_TO_END,),
           "each rank evaluates with its own BatchNorm statistics: the accuracy logged is of "
           "no model saved"),
    Mutant("sync-evaluates-own-shard-only", "sync_sgd_cifar100.py",
           "training.evaluate(model, test_loader, run, comm)\n",
           "training.evaluate(model, test_loader, run)\n",
           (SYNC_END_TO_END,),
           "rank 0 logs the accuracy of its own test shard only"),
    Mutant("test-set-padded", "common/loader.py",
           "range(rank, size, world_size)  # test",
           "[i % size for i in range(rank, math.ceil(size / world_size) * world_size, "
           "world_size)]  # test",
           ("tests/test_data.py::test_test_loader_covers_each_sample_once_without_padding",
            SYNC_END_TO_END_3),
           "test shards padded as DistributedSampler pads: some samples count twice"),
    # ---------------------------------------------------------------------- async SGD
    Mutant("async-worker-ignores-server-parameters", "async_sgd_cifar100.py",
           "            messages.load_parameters(reply[1:])  # continue from the server's "
           "parameters\n", "",
           (BUGS + "test_async_worker_computes_on_the_parameters_the_server_sends",),
           "async workers never load the server's parameters: every gradient at the "
           "initial weights"),
    Mutant("async-workers-share-one-shard", "async_sgd_cifar100.py",
           "rank=comm.rank - 1, world_size=n_workers)",
           "rank=0, world_size=n_workers)",
           (BUGS + "test_async_workers_split_the_training_set_and_reshard_it_each_epoch",),
           "every async worker trains on the first worker's shard: half the data never seen"),
    Mutant("async-staleness-never-counted", "async_sgd_cifar100.py",
           "self.epoch.staleness.append(self.version - self.sent_version[worker])",
           "self.epoch.staleness.append(0)",
           (RULE, "tests/test_distributed.py::"
                  "test_async_sgd_workers_of_different_speeds_stop_cleanly"),
           "the server reports staleness 0 whatever the workers' speeds"),
    Mutant("async-one-momentum-buffer", "async_sgd_cifar100.py",
           "theta, v, mu, lr, n = self.theta, self.momentum[worker],",
           "theta, v, mu, lr, n = self.theta, self.momentum[1],",
           (RULE,),
           "the slides' rule: one momentum buffer for all workers, which a stale gradient "
           "moves for everyone (it diverges on this network)"),
    Mutant("async-reply-not-extrapolated", "async_sgd_cifar100.py",
           "alpha=-(n - 1) * self.lr(self.version + 1) / n,",
           "alpha=0.0,",
           (RULE,),
           "the server replies with its parameters as they are: each gradient is computed "
           "where the parameters were N - 1 updates before it is applied"),
    Mutant("async-reply-extrapolated-backwards", "async_sgd_cifar100.py",
           "alpha=-(n - 1) * self.lr(self.version + 1) / n,",
           "alpha=(n - 1) * self.lr(self.version + 1) / n,",
           (RULE,),
           "the reply is extrapolated against the momentum, away from where the parameters go"),
    Mutant("async-head-left-stale", "async_sgd_cifar100.py",
           "                gradient[part].copy_(fresh.reshape(-1))\n",
           "                pass\n",
           (RULE,),
           "the server applies the head's gradient as the worker computed it, on parameters "
           "N - 1 updates old"),
    Mutant("async-head-labels-misaligned", "common/messages.py",
           "head[self.batch * self.n_features:][:n].copy_(labels)",
           "head[self.batch * self.n_features:][:n].copy_(labels.roll(1))",
           ("tests/test_learning.py::test_async_sgd_with_one_worker_is_nesterov_sgd_step_for_"
            "step",),
           "the worker sends its labels out of step with its features: the server's head "
           "gradient is for other labels"),
    Mutant("async-pull-pushes-away", "async_sgd_cifar100.py",
           "            theta.sub_(self.gap, alpha=pull)",
           "            theta.add_(self.gap, alpha=pull)",
           (RULE,),
           "the pull's sign flipped: each update pushes the parameters further from where its "
           "gradient was computed, amplifying what it should damp"),
    Mutant("async-pull-on-the-head", "async_sgd_cifar100.py",
           "                self.gap[part] = 0.0\n",
           "                pass\n",
           (RULE,),
           "the head is pulled too, though its gradient is computed at the current "
           "parameters: it is dragged back for nothing"),
    Mutant("async-pull-gap-never-measured", "async_sgd_cifar100.py",
           "            torch.sub(theta, self.sent[worker], out=self.gap)\n",
           "",
           (RULE,),
           "the gap is taken from the buffer's old contents (the last update's gap, or "
           "garbage), not from this worker's parameters"),
    Mutant("async-pull-from-another-worker", "async_sgd_cifar100.py",
           "torch.sub(theta, self.sent[worker], out=self.gap)",
           "torch.sub(theta, self.sent[self.workers[0]], out=self.gap)",
           (RULE,),
           "every update is pulled towards the first worker's parameters instead of its own "
           "worker's"),
    Mutant("async-pull-whatever-the-staleness", "async_sgd_cifar100.py",
           "self.version - self.sent_version[worker] >= PULL_FROM else 0",
           "self.version - self.sent_version[worker] >= 0 else 0",
           (RULE,),
           "gradients one update late are pulled too (with 2 workers, nearly every update)"),
    Mutant("async-resume-redoes-the-epoch", "async_sgd_cifar100.py",
           "epoch, start=first_step if epoch == first_epoch else 0):",
           "epoch, start=0):",
           (ASYNC_RESUME,),
           "a run stopped inside an epoch resumes each worker at the epoch's first batch while "
           "the server counts the updates it had: the batches before the stop are trained "
           "twice and the run ends with a row for an epoch past --epochs"),
    Mutant("async-resume-forgets-the-epochs-start", "async_sgd_cifar100.py",
           '        self.new_epoch(state.extra.get("epoch_so_far") if done else None)\n',
           "        self.new_epoch(None)\n",
           (ASYNC_RESUME,),
           "the resumed epoch's row counts only the samples after the stop (its training loss, "
           "accuracy and images/s from part of the epoch)"),
    Mutant("bench-partial-in-one-file", "bench/convergence.py",
           "    partial = partial or partial_path()",
           "    partial = partial_path()",
           ("tests/test_bench.py", "-k", "side_by_side"),
           "convergence.py calls run side by side (one per variant of the rule) write their "
           "runs so far into one file of the repository"),
    Mutant("stop-reply-to-a-gone-worker-raises", "async_sgd_cifar100.py",
           "        except RuntimeError as exc:\n            return self.worker_lost(worker, exc, active)\n",
           "        except ZeroDivisionError as exc:\n"
           "            return self.worker_lost(worker, exc, active)\n",
           ("tests/test_distributed_faults.py", "-k", "stopping_keeps"),
           "the server, stopping on SIGTERM, answers a worker that has died meanwhile: gloo's "
           "error escapes as a traceback and the checkpoint is never written"),
    Mutant("second-lost-worker-still-served", "async_sgd_cifar100.py",
           "                lost = self.worker_lost(worker, error, active)",
           "                lost = failure or self.worker_lost(worker, error, active)",
           ("tests/test_distributed_faults.py", "-k", "both_workers_hang"),
           "a worker lost after another had stopped the run stays among those served: the "
           "server waits for it with none due and ends in a traceback"),
    Mutant("async-server-receives-from-any-source", "common/inbox.py",
           '        self.threaded = dist.get_backend() == "gloo"',
           "        self.threaded = False",
           ("tests/test_distributed_faults.py", "-k", "notices_a_killed or hung_worker"),
           "the server receives from any source, as the slides' loop does: a worker killed or "
           "hung while it computes goes unnoticed, the others train on without its shard to "
           "the end of their epochs, and only then does --timeout end the run"),
    Mutant("async-inbox-keeps-no-timeout", "common/inbox.py",
           "                peer, error = self.arrived.get(timeout=max(self.due[late] - "
           "time.monotonic(), 0))",
           "                peer, error = self.arrived.get()",
           ("tests/test_distributed_faults.py", "-k", "hung_worker"),
           "the server waits for each worker without a limit: a hung worker is never named, "
           "and the others train on without its shard"),
    Mutant("async-no-heartbeat-to-the-workers-done", "common/inbox.py",
           "            if self.messages[peer][0].item() == DONE:  # it waits for its release",
           "            if False:  # it waits for its release",
           ("tests/test_distributed.py", "-k", "different_speeds"),
           "a worker done before a slower one waits for its release in silence: past --timeout "
           "it takes the live server for lost and exits with an error"),
    Mutant("stop-wait-on-a-gone-worker-raises", "common/inbox.py",
           "            if failure is None or not (isinstance(failure, PeerLost) or "
           "is_peer_failure(exc)):",
           "            if not isinstance(failure, PeerLost):",
           ("tests/test_distributed_faults.py", "-k", "stopping_keeps"),
           "a stop reply to a worker that has died fails when waited for: the server ends with "
           "a traceback before it writes the checkpoint"),
    Mutant("inbox-late-message-crashes-the-server", "common/inbox.py",
           "            if self.due.pop(peer, None) is None:",
           "            if self.due.pop(peer) is None:",
           ("tests/test_distributed_faults.py", "-k", "heard_from_just_after"),
           "a worker heard from just after its --timeout, while the server stops: KeyError, a "
           "traceback and exit 1, no checkpoint"),
    Mutant("checkpoint-of-nan-weights", "common/outputs.py",
           "        if not all(t.isfinite().all() for t in model.state_dict().values()):\n",
           "        if False:\n",
           ("tests/test_reliability.py", "-k", "nan_weights_are_never_saved"),
           "a stop, or an epoch's last update, between a NaN and the loss check writes the NaN "
           "weights over the last good checkpoint"),
    Mutant("sync-stop-agreed-every-10-steps-only", "common/collectives.py",
           "        if step % every and step < steps:\n", "        if step % every:\n",
           ("tests/test_distributed_faults.py", "-k", "stop_together and sigterm"),
           "the ranks agree on a stop every 10 steps of an epoch only: in a shorter epoch a "
           "SIGTERM is never honoured"),
    Mutant("sync-nan-loss-seen-by-one-rank-alone", "common/training.py",
           "            if self.comm is not None:  # every rank stops, not only the one that saw "
           "it\n                self.comm.all_reduce(self.first_bad, dist.ReduceOp.MIN)\n", "",
           ("tests/test_distributed_faults.py", "-k", "stop_together and nan"),
           "a NaN loss on one rank stops that rank alone: without mpirun the others exit with "
           "the retryable 200, not 3"),
    Mutant("sync-stop-saves-rank-0s-batchnorm", "sync_sgd_cifar100.py",
           "                comm.average_buffers(model)  # BatchNorm statistics: one model, the "
           "one saved\n                if metrics.stopped:\n"
           "                    folder.stop(state, metrics)  # checkpoint this step, exit 128 + "
           "signal\n",
           "                if metrics.stopped:\n"
           "                    folder.stop(state, metrics)  # checkpoint this step, exit 128 + "
           "signal\n                comm.average_buffers(model)  # BatchNorm statistics: one "
           "model, the one saved\n",
           (SYNC_STOPPED_INSIDE_AN_EPOCH,),
           "a sync SGD stop checkpoints rank 0's BatchNorm statistics, not their mean over "
           "the ranks"),
    Mutant("evaluate-needs-the-checkpoint-on-every-rank", "common/checkpoint.py",
           "    if error:\n        raise UserError(error)\n",
           "    if error or (args.evaluate and not os.path.exists(path)):\n"
           "        raise UserError(error or f\"--evaluate: no checkpoint at {path}\")\n",
           ("tests/test_distributed_faults.py", "-k", "each_hosts_own_disk"),
           "sync --evaluate stops on a rank whose --out (another host's disk) has no "
           "checkpoint, though rank 0 reads it for all"),
    Mutant("broadcast-memory-as-it-lies", "common/collectives.py",
           "data = tensor.data if tensor.is_contiguous() else tensor.data.contiguous()",
           "data = tensor.data",
           ("tests/test_distributed.py", "-k", "identical_parameters"),
           "a contiguous tensor broadcast into a channels_last one (an async worker's with "
           "--amp): its convolution weights arrive permuted"),
    Mutant("resume-pickles-every-view", "common/collectives.py",
           "            torch.save(obj, buffer)\n",
           "            __import__('pickle').Pickler(buffer).dump(obj)\n",
           ("tests/test_distributed.py", "-k", "state_of_views"),
           "the checkpoint is pickled for the other ranks, each tensor with its whole storage: "
           "an async server's 43 MB becomes 1.25 GB"),
    Mutant("nan-server-leaves-its-workers-waiting", "async_sgd_cifar100.py",
           "        except NonFiniteLoss as exc:\n            return exc\n",
           "        except NonFiniteLoss:\n            raise\n",
           ("tests/test_distributed_faults.py", "-k", "weights_turn_nan"),
           "an async server whose weights turn NaN exits alone: its workers wait out --timeout "
           "and exit with the retryable 200"),
    Mutant("async-start-up-wait-bounded-by-the-timeout", "common/collectives.py",
           "            if self.world_size > 1:\n                dist.barrier(group=patient)\n",
           "            pass\n",
           ("tests/test_distributed_faults.py", "-k", "decoding_longer_than_the_timeout"),
           "the server's wait for workers still decoding counts against --timeout: a slow disk "
           "makes every start a retryable 200, for ever"),
    # --------------------------------------------------------------------- real scale
    Mutant("no-progress-lines-in-a-log-file", "common/training.py",
           "        if self.bar is None and time.perf_counter() - self.last_line >= LINE_EVERY:\n",
           "        if False:\n",
           (SCALE + "test_a_long_epoch_leaves_progress_lines_in_a_log_file",
            SCALE + "test_distributed_runs_log_progress_lines_without_a_terminal"),
           "an epoch of many minutes leaves nothing in a log file (no terminal under mpirun, "
           "PBS or nohup)"),
    Mutant("progress-clock-read-every-50-steps", "common/training.py",
           "        if self.bar is None and time.perf_counter() - self.last_line >= LINE_EVERY:\n",
           "        if self.bar is None and self.step % LOG_EVERY == 0 and "
           "time.perf_counter() - self.last_line >= LINE_EVERY:\n",
           (SCALE + "test_a_long_epoch_leaves_progress_lines_in_a_log_file",),
           "the clock read only every 50 steps: with 10-second steps, a line every 8 minutes"),
    Mutant("a-loaders-length-shuffles-the-set", "common/loader.py",
           "math.ceil(len(self.sampler) / self.batch_size)",
           "math.ceil(len(list(self.sampler)) / self.batch_size)",
           ("tests/test_data.py::test_a_loaders_length_draws_no_permutation",),
           "len(loader) builds the whole permutation at every call"),
    Mutant("async-server-silent-in-a-log-file", "async_sgd_cifar100.py",
           "            elif self.last_update - self.last_line >= training.LINE_EVERY:  # for a "
           "log file\n", "            elif False:\n",
           (SCALE + "test_distributed_runs_log_progress_lines_without_a_terminal",),
           "the parameter server says nothing between its epoch lines"),
    Mutant("every-rank-decodes-every-image", "common/data.py",
           "    if comm is None or comm.world_size == 1:\n", "    if True:\n",
           (SCALE + "test_the_ranks_decode_tinyimagenet_once_between_them",),
           "every rank decodes all 110,000 TinyImageNet JPEGs, the parameter server too"),
    Mutant("server-decodes-the-training-set", "common/data.py",
           "return (SKIP, ALONE) if comm.rank == 0", "return (ALONE, ALONE) if comm.rank == 0",
           (SCALE + "test_the_ranks_decode_tinyimagenet_once_between_them",),
           "the parameter server, which never trains, decodes and holds the training set"),
    Mutant("shares-broadcast-from-group-ranks", "common/data.py",
           "src=dist.get_global_rank(group, r)", "src=r",
           (SCALE + "test_the_shared_decoding_gives_the_pixels_of_one_process",),
           "each share broadcast from the group's rank number, not its rank in the world: "
           "async's workers (ranks 1..N) get the wrong pixels or none"),
    Mutant("cifar-shape-by-subsampling", "bench/tiny_to_cifar.py",
           "x.reshape(32, 2, 32, 2, 3).mean(axis=(1, 3))", "x[::2, ::2]",
           (SCALE + "test_tiny_to_cifar_writes_cifar100_pickles_of_real_photos",),
           "64x64 shrunk to 32x32 by keeping every other pixel, not area averaging (aliasing)"),
    # --------------------------------------------------------------- backends and --evaluate
    Mutant("decoded-shares-over-nccl", "common/collectives.py",
           '        if ranks is None and self.device().type == "cpu":\n            return dist.group.WORLD\n',
           "        if ranks is None:\n            return dist.group.WORLD\n",
           ("tests/test_backends.py", "-k", "cuda_tensors_only"),
           "under NCCL the decoded CPU shares go over the NCCL world: sync on TinyImageNet fails "
           "before training"),
    Mutant("every-collective-error-a-lost-peer", "common/peers.py",
           "        if not is_peer_failure(exc):\n            raise\n        raise PeerLost(",
           "        raise PeerLost(",
           ("tests/test_backends.py", "-k", "bug_not_a_lost_peer"),
           "any collective error becomes the retryable 200: a restarting launcher loops for ever"),
    Mutant("sync-evaluate-decodes-the-training-set", "common/data.py",
           "        return SKIP if evaluate else everyone, everyone\n",
           "        return everyone, everyone\n",
           (SCALE + "test_evaluate_decodes_no_training_image[sync_sgd_cifar100.py-decoded0]",),
           "sync --evaluate decodes its share of 100,000 training images it never reads"),
    Mutant("async-evaluate-decodes-the-training-set", "common/data.py",
           "    workers = SKIP if evaluate else comm.cpu_group(", "    workers = comm.cpu_group(",
           (SCALE + "test_evaluate_decodes_no_training_image[async_sgd_cifar100.py-decoded1]",),
           "async workers decode the training set under --evaluate"),
    Mutant("evaluate-alone-decodes-the-training-set", "common/data.py",
           "        return SKIP if evaluate else ALONE, ALONE\n", "        return ALONE, ALONE\n",
           (SCALE + "test_evaluate_alone_decodes_no_training_image",),
           "resnet_tinyimagenet.py --evaluate decodes all training JPEGs"),
    Mutant("trivial-augment-one-operation-per-batch", "common/loader.py",
           "for part in x.split(8)", "for part in [x]",
           ("tests/test_data.py::test_trivial_augment_draws_one_operation_per_group_of_8_images",),
           "TrivialAugment draws one operation for the whole batch (torchvision's v2 on a batch)"),
    Mutant("rotation-one-way-only", "bench/augment.py",
           "* 2 - 1) * math.radians(degrees)", ") * math.radians(degrees)",
           ("tests/test_recipes.py::test_rotation_is_torchvisions_per_image_within_the_range_"
            "either_way",),
           "P2's rotation turns every image the same way (0 to 15 degrees, not -15 to 15)"),
    Mutant("mixup-labels-left-unmixed", "bench/recipes.py",
           "            yield mix(images, labels)\n", "            yield mix(images, labels)[0], labels\n",
           ("tests/test_recipes.py::test_mixed_batches_carry_blended_targets_drawn_after_the_"
            "batch_is_seeded",),
           "MixUp and CutMix blend the images but leave the labels one-hot"),
    Mutant("ema-restarts-at-a-resume", "bench/recipes.py",
           "                emas[decay].load_state_dict(saved[str(decay)])\n", "                pass\n",
           ("tests/test_recipes.py::test_the_emas_follow_the_weights_and_resume_from_their_file",),
           "a resumed run's EMAs start again from the weights of the moment, not from ema.pt"),
    # -------------------------------------------------------------------------- bench/
    Mutant("merge-drops-a-later-files-straggler-pair", "bench/convergence.py",
           '            cfg["straggler"] = delay\n', '            cfg.setdefault("straggler", None)\n',
           ("tests/test_bench.py::test_convergence_merge_keeps_the_straggler_pair_of_a_later_file",),
           "--merge drops a later file's straggler pair from the table"),
    Mutant("merge-refuses-files-from-before-real", "bench/convergence.py",
           "async_flags=[], real=None)", "async_flags=[])",
           ("tests/test_bench.py::test_convergence_merge_pools_files_from_before_real_and_"
            "straggler",),
           "--merge refuses result files written before --real existed"),
    Mutant("merge-pools-two-straggler-delays", "bench/convergence.py",
           'if cfg.get("straggler") not in (None, delay):', "if False:",
           ("tests/test_bench.py::test_convergence_merge_refuses_two_straggler_delays",),
           "--merge pools runs of two straggler delays as seeds of one run"),
    Mutant("bench-import-circle", "bench/exchange.py",
           "    import harness\n    alone = {\"exchange\"",
           "    import run  # noqa: F401\n    import harness\n    alone = {\"exchange\"",
           ("tests/test_bench.py::test_bench_run_only_dispatches_and_no_module_imports_itself_"
            "back",),
           "a benchmark imports the runner back: the circle run -> benchmark -> run"),
]

def tree_files():
    """The files of the working tree that git tracks or would track (untracked, not ignored)."""
    if os.path.isdir(os.path.join(ROOT, ".git")) and shutil.which("git"):
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], cwd=ROOT, capture_output=True,
                                check=True).stdout.decode()
        return sorted(f for f in set(listed.split("\0")) if f and
                      os.path.isfile(os.path.join(ROOT, f)))
    skip = {".git", ".venv", "runs", "data", "__pycache__", ".pytest_cache"}
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip]
        found += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files
                  if not f.endswith(".pyc")]
    return sorted(found)


def copy_tree(files, into):
    for name in files:
        target = os.path.join(into, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, name), target)


def stale(mutant):
    """Why the mutant no longer applies to the working tree, or None."""
    path = os.path.join(ROOT, mutant.file)
    if not os.path.isfile(path):
        return f"{mutant.file} does not exist"
    with open(path) as f:
        count = f.read().count(mutant.original)
    if count != 1:
        return f"its original text is found {count} times in {mutant.file}, not once"
    for node in mutant.tests:  # node ids; a file with "-k", EXPRESSION has no "::"
        if "::" in node:
            test_file, name = node.split("::", 1)
            with open(os.path.join(ROOT, test_file)) as f:
                if f"def {name.split('[')[0]}(" not in f.read():
                    return f"its test {node} does not exist"
    return None


def apply(mutant, tree):
    path = os.path.join(tree, mutant.file)
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace(mutant.original, mutant.replacement, 1))


def run_tests(mutant, tree):
    """(result, seconds, output) of the mutant's tests in `tree`."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               *mutant.tests]
    began = time.monotonic()
    proc = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=mutant.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # pytest and whatever it started (mpirun, ranks)
        output, _ = proc.communicate()
        return f"error (timeout {mutant.timeout} s)", time.monotonic() - began, output
    seconds = time.monotonic() - began
    if proc.returncode == 1:  # tests ran and at least one failed
        return "killed", seconds, output
    if proc.returncode == 0:
        return "survived", seconds, output
    return f"error (pytest exit {proc.returncode})", seconds, output


def baseline(chosen, files, scratch):
    """Run the chosen mutants' tests on an unmutated copy: a mutant is "killed" only where
    they pass without it.  Returns (passed, seconds, output)."""
    subsets = list(dict.fromkeys(m.tests for m in chosen))
    if not any(arg.startswith("-") for tests in subsets for arg in tests):  # node ids: one run
        subsets = [tuple(dict.fromkeys(arg for tests in subsets for arg in tests))]
    tree = os.path.join(scratch, "unmutated")
    copy_tree(files, tree)
    seconds, outputs = 0.0, []
    for tests in subsets:
        clean = Mutant("unmutated", "", "", "", tests, "", timeout=1800)
        result, took, output = run_tests(clean, tree)
        seconds += took
        outputs.append(output)
        if result != "survived":  # i.e. not every test passed
            return False, seconds, output
    shutil.rmtree(tree, ignore_errors=True)
    return True, seconds, outputs[-1]


def short(tests):
    return " ".join(t.replace("tests/", "").replace("test_classic_bugs.py::", "bugs::")
                    for t in tests)


def print_table(rows):
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for k, row in enumerate(rows):
        print("  ".join(cell.ljust(w) if i < 3 else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths))).rstrip())
        if k == 0:
            print("  ".join("-" * w for w in widths))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copies")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the first run of the tests on the unmutated tree")
    parser.add_argument("--tests", nargs="+", metavar="TEST",
                        help="run these pytest arguments against the chosen mutants instead of "
                             "their own tests (does another test catch them too?)")
    args = parser.parse_args(argv)

    names = [m.name for m in MUTANTS]
    assert len(set(names)) == len(names), "two mutants share a name"
    chosen = MUTANTS
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            print(f"error: no mutant named {', '.join(unknown)}; --list shows them",
                  file=sys.stderr)
            return 2
        chosen = [m for m in MUTANTS if m.name in args.only]
    if args.tests:
        chosen = [dataclasses.replace(m, tests=tuple(args.tests)) for m in chosen]
    if args.list:
        for m in chosen:
            print(f"{m.name}  ({m.file})\n    bug:   {m.bug}\n    tests: {short(m.tests)}")
        return 0

    files = tree_files()
    scratch = tempfile.mkdtemp(prefix="mutants-")
    rows = [("mutant", "tests run", "result", "seconds")]
    failed = []
    began = time.monotonic()
    try:
        if not args.no_baseline:
            print("the tests on the unmutated tree first ...", flush=True)
            passed, seconds, output = baseline(chosen, files, scratch)
            if not passed:
                print("\n".join(output.rstrip().splitlines()[-30:]))
                print(f"\nthe unmutated tree fails these tests ({seconds:.0f} s): a failure "
                      "could not be told from a kill; fix the tests or the tree first")
                return 2
            print(f"    they pass ({seconds:.0f} s)", flush=True)
        for k, mutant in enumerate(chosen, 1):
            why = stale(mutant)
            if why:
                result, seconds, output = f"error (stale: {why})", 0.0, ""
            else:
                tree = os.path.join(scratch, mutant.name)
                copy_tree(files, tree)
                apply(mutant, tree)
                result, seconds, output = run_tests(mutant, tree)
                if not args.keep:
                    shutil.rmtree(tree, ignore_errors=True)
            rows.append((mutant.name, short(mutant.tests), result, f"{seconds:.0f}"))
            print(f"[{k}/{len(chosen)}] {mutant.name}: {result} ({seconds:.0f} s)", flush=True)
            if result == "killed":  # the evidence: which test failed, and how
                lines = output.splitlines()
                failed_test = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
                reason = [ln for ln in lines if ln.startswith("E ")]
                for line in failed_test[:1] + reason[:1]:
                    print("    " + line[:200], flush=True)
            else:
                failed.append(mutant.name)
                tail = "\n".join(output.rstrip().splitlines()[-15:])
                if tail:
                    print("    " + tail.replace("\n", "\n    "), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    print()
    print_table(rows)
    total = time.monotonic() - began
    killed = len(chosen) - len(failed)
    print(f"\n{killed} of {len(chosen)} mutants killed in {total / 60:.1f} min"
          + (f"; not killed: {', '.join(failed)}" if failed else ""))
    if args.keep:
        print(f"scratch copies kept in {scratch}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
