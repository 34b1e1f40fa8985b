"""main() of train_gpt.py with the harness: options read and checked, signals watched, the ranks
joined and agreeing, and one line and an exit code for each way a run ends (docs/failures.md)."""

import contextlib
import ctypes
import dataclasses
import hashlib
import os
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

import train_gpt as tg


def die_with_the_launcher(environ):
    """Under torchrun, a rank that outlived its launcher (killed, or ended by a third Ctrl-C that no
    longer waits for its processes) would hold its GPU until the dist timeout: Linux kills it along."""
    if "TORCHELASTIC_RUN_ID" in environ and sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        with contextlib.suppress(AttributeError, OSError):  # no prctl: the rank may outlive its launcher
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def stop_signals():
    """STOP_SIGNALS, less SIGHUP where it is ignored: under nohup the run is to outlive its terminal."""
    return [s for s in tg.STOP_SIGNALS if s != signal.SIGHUP or signal.getsignal(s) != signal.SIG_IGN]


@contextlib.contextmanager
def signals_handled_by(handler, signums):
    """signums go to handler meanwhile, then back to what they were (main thread only: Python
    sets handlers nowhere else)."""
    before = {}
    try:  # each noted before it changes: a handler that raises as soon as it is in still puts all back
        for signum in signums if threading.current_thread() is threading.main_thread() else ():
            before[signum] = signal.getsignal(signum)
            signal.signal(signum, handler)
        yield
    finally:
        for signum, previous in before.items():
            signal.signal(signum, previous)


class RankMismatch(RuntimeError):
    """Ranks that cannot work together: absent, or running different code or configuration."""


def run_fingerprint(args):
    """A hash of the code that runs and the configuration: ranks that disagree would deadlock later."""
    digest = hashlib.sha256((tg.logged_code() + repr(sorted(dataclasses.asdict(args).items()))).encode())
    return int.from_bytes(digest.digest()[:7], "little")  # fits in int64


def gathered(values, ranks, hw):
    """Every rank's tuple of int64 values, in rank order (every rank must call it)."""
    mine = torch.tensor(values, dtype=torch.int64, device=hw.device)
    everyone = [torch.empty_like(mine) for _ in range(ranks.world_size)]
    dist.all_gather(everyone, mine)
    return [tuple(int(v) for v in theirs) for theirs in everyone]


def check_ranks_agree(args, ranks, hw):
    fingerprints = [f for (f,) in gathered([run_fingerprint(args)], ranks, hw)]
    if len(set(fingerprints)) > 1:
        odd = [r for r, f in enumerate(fingerprints) if f != fingerprints[0]]
        raise RankMismatch(f"ranks {odd} run different code or configuration than rank 0 "
                           f"(fingerprints {fingerprints}); launch every rank with the same train_gpt.py and options")


class SetupError(RuntimeError):
    """A failure in the set-up other than the data's or the checkpoint's (out of memory, a bug)."""


class PeerDataError(tg.DataError):
    """Another rank failed in set-up before training (its data files, its checkpoint, memory);
    that rank reports it, this one ends quietly."""


class Interrupted(Exception):
    """A tg.STOP_SIGNALS signal arrived before the training loop (set-up, compilation, warmup), or came
    again in the loop (StopSignals says when).
    rank_alone: set where a signal that reached only some ranks in set-up ends them all.
    step: where the run stands (a resumed one's warmup: the checkpoint's step)."""
    rank_alone = None

    def __init__(self, step=0):
        super().__init__()
        self.step = step


class StopSignals:
    """The handler of STOP_SIGNALS while main() runs. In set-up and warmup a signal raises
    Interrupted at once. In the training loop it is announced and recorded: the loop stops at its
    next check, which every rank reaches at the same step, so all of them leave the process group
    together. A second signal there (the user insisting; under torchrun, the SIGTERM that a second
    Ctrl-C makes it send) raises Interrupted mid-step. After the loop a signal is announced and
    changes nothing. One more after that, or after a stop mid-step, takes the signal's default
    action at once, so a clean-up that hangs can still be stopped. The same signal again within
    FORWARDED_WITHIN_S of one acted on is a copy, ignored: scancel signals every process of a job,
    and torchrun passes the signal on too."""
    FORWARDED_WITHIN_S = 1.0

    def __init__(self, announce=True, world_size=1, check_every=1):
        self.announce = announce  # one process per machine says what happens next
        self.phase = "set-up"  # then "loop" (until_text says when a signal stops it), then "end"
        self.until_text = ("stops after this step" if world_size == 1 else
                           f"stops at its next check, within {check_every} step" + "s" * (check_every > 1))
        self.signum = None  # the first signal
        self.repeat = None  # the signal that stopped the loop mid-step
        self._last = (None, 0.0)  # the last signal acted on, and when

    def __call__(self, signum, frame):
        now = time.monotonic()
        if signum == self._last[0] and now - self._last[1] < self.FORWARDED_WITHIN_S:
            return  # a copy of the signal just acted on
        self._last = (signum, now)
        if self.signum is None:
            self.signum = signum
            if self.phase == "set-up":
                raise Interrupted()
            name = signal.Signals(signum).name
            what = self.until_text if self.phase == "loop" else "is ending"
            if self.announce:
                # os.write: print() may be in the middle of a write in the main thread. OSError: the
                # console has gone (`| tee`, ended by the same Ctrl-C).
                with contextlib.suppress(OSError):
                    os.write(1, f"{name}: the run {what} ({name} again to stop at once)\n".encode())
        elif self.phase == "loop" and self.repeat is None:
            self.repeat = signum
            raise Interrupted()
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def stopped_mid_step(self):
        """The last line's reason where a second signal stopped the loop mid-step."""
        first, repeat = signal.Signals(self.signum).name, signal.Signals(self.repeat).name
        return f"{first} twice" if first == repeat else f"{first} then {repeat}"


def late_failure(error, phase, step, result, args, ranks, log, stop, checkpoints):
    """train()'s exception after set-up (a bad shard, out of memory, a lost rank, a fork's bug) as
    one line in result and a complete log; a signal in compilation or warmup raises Interrupted."""
    if stop.signum is not None and phase == "set-up":  # the compiler may have wrapped its Interrupted
        if checkpoints is not None:
            checkpoints.log_where_to_go_on()
        raise Interrupted(step=checkpoints.resumed_step if checkpoints else 0) from None
    N = args.num_iterations
    where = f"rank {ranks.rank}: " if ranks.world_size > 1 else ""  # perhaps this rank's alone
    if stop.repeat is not None:  # the user insisted: this rank ends mid-step, the others where theirs are
        result.failure = f"interrupted at step {step}/{N} ({stop.stopped_mid_step()}: stopped mid-step)"
    elif isinstance(error, tg.DataError):  # its line says all: which file, what is wrong
        result.failure = f"{where}{error}"
    else:
        if not getattr(log, "path", None) or getattr(log, "error", None):  # no log file to hold the traceback
            traceback.print_exception(error)
        log("".join(traceback.format_exception(error)).rstrip(), console=False)
        result.failure = f"{where}failed at step {step}/{N}: {type(error).__name__}: {tg.first_line(error)}"
        result.traceback_logged = True
    result.exit_code, result.crashed = 128 + stop.signum if stop.repeat is not None else tg.EXIT_ERROR, True


def join(args, ranks, hw):
    """train_gpt.init_process_group, then a check that every rank runs the same code and config."""
    # The wait for the others is one C++ call, in which Python's signal handlers cannot run until it
    # ends (after --dist_timeout_s): a signal then takes its default action at once. Nothing is
    # written yet, and torchrun would otherwise kill the process 30 s after its SIGTERM.
    started = time.monotonic()
    try:
        with signals_handled_by(signal.SIG_DFL, stop_signals()):
            tg.init_process_group(args, ranks, hw)
    except (RuntimeError, ValueError) as e:  # DistError is a RuntimeError; ValueError: a bad MASTER_ADDR/PORT
        waited = time.monotonic() - started  # early: the store closed under this rank (its host stopped)
        when = (f" within --dist_timeout_s={args.dist_timeout_s}" if waited >= args.dist_timeout_s else
                f": failed after {waited:.1f} s, before --dist_timeout_s={args.dist_timeout_s} ran out")
        raise RankMismatch(f"rank {ranks.rank}: could not join {ranks.world_size} ranks{when} "
                           f"({tg.first_line(e)})") from None
    if ranks.world_size > 1:
        check_ranks_agree(args, ranks, hw)


def agree_on_set_up(failure, ranks, hw, checkpoints=None):
    """Each rank reads the files itself and builds the model, so one may fail alone (a flaky network
    filesystem, out of memory) while the others would wait at their next collective for the dist
    timeout. So the ranks agree after set-up: the lowest rank that failed says why, once, and every
    rank ends. train() calls this on every rank (failure: this rank's, or None)."""
    all_failed = True  # as far as this rank knows
    if ranks.world_size > 1:
        failed = failure is not None
        outcome = torch.tensor([ranks.rank if failed else ranks.world_size, int(failed)], device=hw.device)
        dist.all_reduce(outcome, op=dist.ReduceOp.MIN)  # the lowest failed rank; 1 if every rank failed
        first_failed, all_failed = outcome.tolist()
        if first_failed not in (ranks.rank, ranks.world_size):
            if isinstance(failure, Interrupted):  # a signal reaches every rank: each ends as signalled
                raise failure
            raise PeerDataError(f"rank {first_failed} failed in set-up")
        if failed and not all_failed and isinstance(failure, tg.DataError):
            raise tg.DataError(f"rank {ranks.rank}: {failure}") from None
        if failed and not all_failed and isinstance(failure, Interrupted):
            failure.rank_alone = ranks.rank  # the ranks it stops end quietly: this one must say why
    if failure is not None and not isinstance(failure, (tg.DataError, tg.ConfigError, Interrupted)):
        traceback.print_exception(failure)  # out of memory, or a fork's bug: where it happened
        where = "" if all_failed else f"rank {ranks.rank}: "
        raise SetupError(f"{where}failed in set-up: {type(failure).__name__}: {tg.first_line(failure)}") from None
    if failure is not None:
        raise failure
    if checkpoints is not None:
        checkpoints.check_ranks_hold_one()


def main(argv=None, environ=None):
    argv = sys.argv[1:] if argv is None else argv
    environ = os.environ if environ is None else environ
    config = tg.harness("config")
    ranks = None
    try:
        ranks = config.ranks_from_env(environ)
        die_with_the_launcher(environ)
        # Before the configuration is read: a typo may be why it is refused, or what --help shows.
        for line in config.near_misses_in_environment(environ) if ranks.local_rank == 0 else ():
            tg.say(line, sys.stderr)
        args = config.parse_config(argv, environ, ranks.world_size, verify_checkpoint=ranks.local_rank == 0)
        cli = config.command_line_options(argv)[0]  # parse_config accepted it
        from_environment = config.set_by_environment(cli, environ)
        if args.sample:
            return tg.harness("sample").sample_main(args, set(cli) | from_environment)
        if ranks.is_master:  # the only rank that writes there
            try:
                config.check_log_dir(args)
            except tg.ConfigError as e:
                inherited = args.resume and "log_dir" not in cli and "log_dir" not in from_environment
                raise config.from_the_checkpoint(e, {"log_dir"} if inherited else ()) from None
        config.check_machine(args, ranks)
        hw = tg.Hardware.detect(args, ranks)
    except tg.ConfigError as e:
        # Every process of a machine reads the same options, environment and GPUs: its local rank
        # 0 speaks for all, so torchrun's console shows the line once per machine.
        if ranks is None or ranks.local_rank == 0:
            tg.say(f"train_gpt.py: error: {config.named_as_set(str(e), argv, environ)}", sys.stderr)
        return tg.EXIT_CONFIG
    except config.HelpRequested as e:
        tg.say(str(e))
        return 0
    if hw.device.type == "cpu":
        torch.set_num_threads(args.threads or max(1, tg.usable_cpus() // ranks.local_world_size))
        tg.keep_freed_memory_on_cpu()
    if ranks.is_master and from_environment:  # a variable left in the shell changes the run: say so
        tg.say("set by the environment: " + ", ".join(f"{name.upper()}={environ[name.upper()]}"
                                                      for name in sorted(from_environment)))
    log = tg.RunLog(args, ranks)
    stop = StopSignals(ranks.local_rank == 0, ranks.world_size, args.check_every)
    result = None
    # The caller's handlers come back last, after leaving the process group (main() called in-process,
    # as tests do, leaves them as they were); installed inside the try, which reports a signal at once.
    with contextlib.ExitStack() as handlers:
        try:
            handlers.enter_context(signals_handled_by(stop, stop_signals()))
            join(args, ranks, hw)
            result = tg.train(args, ranks, hw, log, stop=stop)
        except (tg.DataError, RankMismatch, tg.ConfigError, SetupError) as e:
            stop.phase = "end"  # first: a signal from here on cannot raise (a peer's exit makes torchrun send one)
            if not isinstance(e, PeerDataError):
                tg.say(f"train_gpt.py: error: {config.named_as_set(str(e), argv, environ)}", sys.stderr)
            return tg.EXIT_ERROR
        except Interrupted as e:  # before the training loop: nothing trained yet
            # One report per machine, as for a bad option; or by the one rank a signal reached in set-up.
            if log.started or ranks.local_rank == 0 or e.rank_alone is not None:
                report = log if log.started else tg.say
                which = f"rank {e.rank_alone}: " if e.rank_alone is not None else ""
                report(f"{which}interrupted at step {e.step}/{args.num_iterations} "
                       f"({signal.Signals(stop.signum).name})")
                report(tg.peak_memory_line(hw))
            if log.started:  # before the loop: nothing trained yet
                tg.say(tg.run_summary(args, tg.TrainResult(), log))
            return 128 + stop.signum
        finally:
            stop.phase = "end"
            tg.leave_process_group(clean=result is not None and not result.crashed)
    code = exit_code(result, log, args)
    if log.started:  # the last line: how the run ended, and where its log is
        tg.say(tg.run_summary(args, result, log))
    return code


def exit_code(result, log, args):
    """main()'s exit code for a run that trained, with the error line of one that failed."""
    if result.crashed and result.exit_code == tg.EXIT_ERROR:  # every rank that failed says so; the log has the traceback
        in_log = f" (traceback in {log.path})" if result.traceback_logged and log.path and not log.error else ""
        tg.say(f"train_gpt.py: error: {result.failure}{in_log}", sys.stderr)
        return tg.EXIT_ERROR
    if result.exit_code == tg.EXIT_ERROR or (log.error and not result.exit_code):  # a write may fail after the last check
        line = result.failure or f"{log.error} at step {result.steps_done}/{args.num_iterations}"
        tg.say(f"train_gpt.py: error: {line}; the lines written before are kept", sys.stderr)
        return tg.EXIT_ERROR
    if result.exit_code:
        return result.exit_code
    if result.checkpoint_error:
        tg.say(f"train_gpt.py: error: {result.checkpoint_error}", sys.stderr)
        return tg.EXIT_ERROR
    return tg.EXIT_DATA_RAN_OUT if result.stopped_early else 0
