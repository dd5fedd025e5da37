# Trusted test runner of the collabllm-rs sandbox (src/reward/sandbox.rs, `include_str!`).
#
# This process (the *reporter*) never imports the code under test. It loads the tests with a
# stand-in `solution` module, takes a snapshot of everything a test verdict depends on, and then
# runs each test in a forked child that imports the candidate, runs that one test and checks the
# snapshot afterwards. The child reports over a pipe only it holds; the reporter writes the
# totals on a copy of stdout, tagged with a nonce that it reads from stdin only after the last
# child is gone (so no candidate process ever had it in memory).
#
# Input on stdin, read unbuffered so that nothing beyond what is asked for enters this process:
# 16 ASCII digits (a byte count), that many bytes of JSON {"solution": str, "tests": str}, and
# later one line with the nonce.
#
# What remains possible is listed in the module docs of sandbox.rs ("What cannot be forged").

import ast
import builtins
import gc
import importlib
import json
import os
import signal
import sys
import traceback
import types
import unittest
import unittest.runner
# The runner's own code uses these names; binding them here (module globals shadow builtins)
# keeps the checks working when the candidate replaces the builtins.
from builtins import (BaseException, Exception, callable, dict, getattr, hasattr, id, int,
                      isinstance, issubclass, len, list, object, open, set, str, type)

_SOLUTION_FILE = "solution.py"
_TESTS_FILE = "test_solution.py"
# Instance attributes unittest itself sets on a TestCase.
_UNITTEST_INSTANCE_ATTRS = frozenset(
    ["_testMethodName", "_outcome", "_testMethodDoc", "_cleanups", "_subtest",
     "_type_equality_funcs"]
)
# Modules whose functions and classes decide a verdict (prefix match on dotted names), and
# packages of which only the top level and `testing` modules are watched.
_WATCHED = ("builtins", "sys", "unittest", "contextlib", "functools", "operator", "math",
            "cmath", "numbers", "decimal", "fractions", "collections", "re", "difflib")
_WATCHED_TOP = ("numpy", "pandas", "torch", "scipy", "sklearn", "matplotlib")
_BUILTIN_TYPES = (object, type, int, float, complex, bool, str, bytes, bytearray, list,
                  tuple, dict, set, frozenset, type(None), range, slice, memoryview,
                  BaseException, Exception, AssertionError, type(NotImplemented))


def _read_exact(fd, n):
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 16))
        if not chunk:
            raise EOFError("stdin closed early")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _read_line(fd, limit=256):
    out = bytearray()
    while len(out) < limit:
        b = os.read(fd, 1)
        if not b or b == b"\n":
            break
        out += b
    return out.decode("ascii", "replace").strip()


def _set_dumpable(flag):
    # PR_SET_DUMPABLE = 4. A non-dumpable process cannot be ptraced and its /proc/<pid>/fd and
    # /proc/<pid>/mem cannot be opened by other processes of the same uid.
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(4, int(flag), 0, 0, 0) == 0
    except Exception:
        return False


class _Placeholder:
    """A name the tests import from `solution` while they are loaded without it."""

    __slots__ = ("_name",)

    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError("the tests use `%s` from the solution while loading" % self._name)

    def __repr__(self):
        return "<solution.%s, not loaded>" % self._name


def _stub_module():
    stub = types.ModuleType("solution")

    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name)

    stub.__getattr__ = __getattr__
    return stub


def _load_tests(source, path):
    """Executes the tests (trusted) with a stand-in `solution` module."""
    stub = _stub_module()
    module = types.ModuleType("test_solution")
    module.__file__ = path
    sys.modules["solution"] = stub
    sys.modules["test_solution"] = module
    try:
        exec(compile(source, path, "exec", dont_inherit=True), module.__dict__)
    finally:
        sys.modules.pop("solution", None)
    return module, stub


def _enumerate(module):
    """(attribute, method) of every test unittest's loader would run, and the count of tests
    skipped by a decorator (those are not run and not counted)."""
    loader = unittest.TestLoader()
    tests, skipped = [], 0
    for attr in dir(module):
        obj = getattr(module, attr, None)
        if not (isinstance(obj, type) and issubclass(obj, unittest.TestCase)):
            continue
        for name in loader.getTestCaseNames(obj):
            method = getattr(obj, name, None)
            if getattr(obj, "__unittest_skip__", False) or getattr(method, "__unittest_skip__", False):
                skipped += 1
            else:
                tests.append((attr, name))
    return tests, skipped


def _preimport(source):
    """Imports the modules the solution imports at top level, here, before the snapshot: they
    are installed (trusted) code, and importing them once here saves each child the time."""
    try:
        tree = ast.parse(source)
    except Exception:
        return
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names.extend(node.module + "." + alias.name for alias in node.names if alias.name != "*")
    for name in names:
        if name.split(".")[0] in ("solution", "test_solution"):
            continue
        try:
            importlib.import_module(name)
        except BaseException:
            pass


def _watched(name):
    for w in _WATCHED:
        if name == w or name.startswith(w + "."):
            return True
    top = name.split(".")[0]
    return top in _WATCHED_TOP and (name == top or ".testing" in name or "._testing" in name)


def _guarded(value):
    # Functions, classes, builtins, descriptors: what a patch would replace. Plain data (maxDiff,
    # caches, counters) changes legitimately.
    return callable(value) or hasattr(type(value), "__get__")


_TYPE_DICT = type.__dict__["__dict__"].__get__
_TYPE_MRO = type.__dict__["__mro__"].__get__
_SUBCLASSES = type.__subclasses__


def _all_classes():
    seen, stack = {}, [object]
    while stack:
        cls = stack.pop()
        try:
            subs = _SUBCLASSES(cls)
        except TypeError:
            continue
        for sub in subs:
            if id(sub) not in seen:
                seen[id(sub)] = sub
                stack.append(sub)
    return seen


class _Snapshot:
    """Everything a verdict depends on, captured before any candidate code ran."""

    def __init__(self, test_module, stub):
        self.entries = []  # (label, mapping, key, value)
        self.modules = {}  # name -> module
        seen_classes = set()

        def add_class(cls, everything):
            if id(cls) in seen_classes:
                return
            seen_classes.add(id(cls))
            d = _TYPE_DICT(cls)
            for key, value in list(d.items()):
                if everything or _guarded(value):
                    self.entries.append((cls.__qualname__, d, key, value))

        for t in _BUILTIN_TYPES:
            add_class(t, True)
        for name, module in list(sys.modules.items()):
            if module is None or not _watched(name):
                continue
            self.modules[name] = module
            d = module.__dict__
            for key, value in list(d.items()):
                if _guarded(value):
                    self.entries.append((name, d, key, value))
                if isinstance(value, type):
                    add_class(value, False)
        tm = test_module.__dict__
        for key, value in list(tm.items()):
            if isinstance(value, _Placeholder) or value is stub:
                continue
            if isinstance(value, types.ModuleType):
                self.modules.setdefault(value.__name__, value)
            if _guarded(value):
                self.entries.append(("test_solution", tm, key, value))
            if isinstance(value, type) and getattr(value, "__module__", None) == "test_solution":
                add_class(value, False)
        self.trace = sys.gettrace()
        self.profile = sys.getprofile()
        self.classes = _all_classes()
        self.test_module = test_module
        self.stub = stub


_MISSING = object()


class _Sentinel:
    """Compared with instances of the candidate's classes: nothing honest equals it."""

    __slots__ = ()


def _always_equal(cls, known):
    owner = None
    for k in _TYPE_MRO(cls):
        if "__eq__" in _TYPE_DICT(k):
            owner = k
            break
    if owner is None or id(owner) in known:
        return False
    try:
        inst = object.__new__(cls)
    except BaseException:
        try:
            inst = cls.__new__(cls)
        except BaseException:
            return False
    try:
        return bool(inst == _Sentinel())
    except BaseException:
        return False


def _tampering(snap, test, equality_funcs, created):
    why = []
    for label, mapping, key, value in snap.entries:
        if mapping.get(key, _MISSING) is not value:
            why.append("%s.%s replaced" % (label, key))
            if len(why) >= 5:
                return why
    for name, module in snap.modules.items():
        if sys.modules.get(name) is not module:
            why.append("sys.modules[%r] replaced" % name)
    if sys.gettrace() is not snap.trace or sys.getprofile() is not snap.profile:
        why.append("a trace or profile hook installed")
    for key, value in list(test.__dict__.items()):
        if key not in _UNITTEST_INSTANCE_ATTRS and callable(value) and hasattr(type(test), key):
            why.append("test method %s shadowed on the instance" % key)
    current = test.__dict__.get("_type_equality_funcs")
    for key, value in equality_funcs.items():
        if not isinstance(current, dict) or current.get(key, _MISSING) is not value:
            why.append("assertEqual's type dispatch changed")
            break
    candidates = dict(_all_classes())
    for cls in created:
        candidates.setdefault(id(cls), cls)
    for key, cls in candidates.items():
        if key not in snap.classes and _always_equal(cls, snap.classes):
            why.append("class %s compares equal to anything" % getattr(cls, "__qualname__", "?"))
    return why


def _bind_solution(test_module, stub, solution):
    """What `from solution import *` / `import solution` would have bound in the tests."""
    d = test_module.__dict__
    for key, value in list(d.items()):
        if value is stub:
            d[key] = solution
        elif isinstance(value, _Placeholder):
            if hasattr(solution, value._name):
                d[key] = getattr(solution, value._name)
    public = getattr(solution, "__all__", None)
    if public is None:
        public = [k for k in solution.__dict__ if not k.startswith("_")]
    for key in public:
        if key not in d and hasattr(solution, key):
            d[key] = getattr(solution, key)


# Pristine references, taken when this file is executed (before any candidate code).
_P_write = os.write
_P_exit = os._exit
_P_TextTestResult = unittest.TextTestResult
_P_TestSuite = unittest.TestSuite
_P_Writeln = unittest.runner._WritelnDecorator
_P_print_exc = traceback.print_exc
_P_ModuleType = types.ModuleType


def _run_one(snap, cls_attr, method, solution_code, solution_path, created):
    """In the child: import the candidate, run one test, check the snapshot. (ok, why)."""
    solution = _P_ModuleType("solution")
    solution.__file__ = solution_path
    sys.modules["solution"] = solution
    try:
        exec(solution_code, solution.__dict__)
    except BaseException:
        _P_print_exc()
        return False, "the solution failed to import"
    _bind_solution(snap.test_module, snap.stub, solution)
    cls = snap.test_module_classes[cls_attr]
    test = cls(method)
    equality_funcs = dict(test.__dict__.get("_type_equality_funcs") or {})
    try:
        result = _P_TextTestResult(_P_Writeln(sys.stderr), True, 2)
        _P_TestSuite([test]).run(result)
        result.printErrors()
        sys.stderr.flush()
        ok = (result.testsRun == 1 and not result.failures and not result.errors
              and not result.skipped and not result.unexpectedSuccesses)
    except BaseException:
        # unittest itself broke (a replaced builtin, say): say why below if we can.
        ok = False
    why = _tampering(snap, test, equality_funcs, created)
    if why:
        return False, "tampering: " + "; ".join(why)
    return ok, "" if ok else "failed"


def _child(snap, key, solution_code, solution_path, token, wfd, created):
    try:
        os.dup2(2, 1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        # Nothing of the reporter's stays open here but the report pipe.
        os.closerange(3, wfd)
        os.closerange(wfd + 1, 1 << 16)
        try:
            os.setpgid(0, 0)
        except OSError:
            pass
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _set_dumpable(True)
        ok, why = _run_one(snap, key[0], key[1], solution_code, solution_path, created)
    except BaseException as exc:
        ok, why = False, "runner error: " + type(exc).__name__
    line = token + (" PASS" if ok else " FAIL " + why.replace("\n", " ")[:500]) + "\n"
    try:
        _P_write(wfd, line.encode("utf-8", "replace"))
    finally:
        _P_exit(0)


def _drain(fd):
    os.set_blocking(fd, False)
    data = b""
    while len(data) < 1 << 16:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    return data


def _kill_leftovers(pid):
    if os.getpid() == 1:
        # Init of our PID namespace: every other process in it is the candidate's.
        while True:
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def _run_in_child(snap, key, solution_code, solution_path, created):
    rfd, wfd = os.pipe()
    token = os.urandom(16).hex()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        _child(snap, key, solution_code, solution_path, token, wfd, created)
    os.close(wfd)
    _, status = os.waitpid(pid, 0)
    data = _drain(rfd)
    os.close(rfd)
    _kill_leftovers(pid)
    lines = [l for l in data.split(b"\n") if l]
    exited_cleanly = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    if len(lines) == 1 and exited_cleanly and lines[0] == (token + " PASS").encode():
        return True, ""
    if len(lines) == 1 and lines[0].startswith((token + " FAIL").encode()):
        return False, lines[0][len(token) + 6:].decode("utf-8", "replace")
    if not lines:
        return False, "no report (the process exited or was killed during the test)"
    return False, "invalid report"


def _main():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_dumpable(False)
    sys.path[:] = [p for p in sys.path if p not in ("", ".", os.getcwd())]
    header = _read_exact(0, 16)
    payload = json.loads(_read_exact(0, int(header)).decode("utf-8"))
    here = os.getcwd()
    solution_path = os.path.join(here, _SOLUTION_FILE)
    tests_path = os.path.join(here, _TESTS_FILE)
    for path, text in ((solution_path, payload["solution"]), (tests_path, payload["tests"])):
        # For tracebacks and `inspect`; the code is compiled from memory, never from these.
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError:
            pass
    report = {"tests_run": 0, "passed": 0, "failures": 0, "errors": 0, "skipped": 0,
              "tampered": 0, "load_error": None, "failed": []}
    try:
        solution_code = compile(payload["solution"], solution_path, "exec", dont_inherit=True)
    except BaseException as exc:
        _P_print_exc()
        report["load_error"] = type(exc).__name__
        return report
    try:
        test_module, stub = _load_tests(payload["tests"], tests_path)
        tests, skipped = _enumerate(test_module)
    except BaseException as exc:
        _P_print_exc()
        report["load_error"] = "tests: " + type(exc).__name__
        return report
    _preimport(payload["solution"])
    del payload
    # Classes made by `class` statements are kept alive, so that one the candidate defines and
    # drops is still there to be checked after the test.
    created = []
    original_build_class = builtins.__build_class__

    def __build_class__(func, name, *bases, **kwargs):
        cls = original_build_class(func, name, *bases, **kwargs)
        created.append(cls)
        return cls

    builtins.__build_class__ = __build_class__
    snap = _Snapshot(test_module, stub)
    snap.test_module_classes = {attr: getattr(test_module, attr) for attr, _ in tests}
    report["skipped"] = skipped
    for key in tests:
        ok, why = _run_in_child(snap, key, solution_code, solution_path, created)
        report["tests_run"] += 1
        if ok:
            report["passed"] += 1
        else:
            report["failures"] += 1
            report["tampered"] += int(why.startswith("tampering"))
            name = "%s.%s" % key
            report["failed"].append(name if not why else name + ": " + why)
            sys.stderr.write("collabllm sandbox: %s did not pass (%s)\n" % (name, why or "failed"))
    return report


def _finish():
    report_fd = os.dup(1)
    os.dup2(2, 1)  # anything printed from here on goes to stderr
    try:
        report = _main()
    except BaseException as exc:
        try:
            _P_print_exc()
        except BaseException:
            pass
        report = {"tests_run": 0, "passed": 0, "failures": 0, "errors": 0, "skipped": 0,
                  "tampered": 0, "load_error": "runner: " + type(exc).__name__, "failed": []}
    try:
        sys.stderr.flush()
    except BaseException:
        pass
    report["failed"] = report["failed"][:50]
    nonce = _read_line(0)
    line = "\nCOLLABLLM-RESULT-" + nonce + " " + json.dumps(report) + "\n"
    try:
        _P_write(report_fd, line.encode())
    except OSError:
        pass
    ok = report["load_error"] is None and report["tests_run"] > 0 and report["passed"] == report["tests_run"]
    _P_exit(0 if ok else 1)


_finish()
