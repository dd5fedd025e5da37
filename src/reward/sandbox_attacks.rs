//! Tests of what the sandbox guarantees against hostile code: forged verdicts score nothing, and
//! the code sees a private, size-limited `/tmp` and `/dev/shm` and only its own processes.

use super::*;

const WRONG: &str = "def add(a, b):\n    return a - b\n";
const ADD_TESTS: &str = "import unittest\n\nclass TestAdd(unittest.TestCase):\n    def test_small(self):\n        self.assertEqual(add(1, 2), 3)\n\n    def test_negative(self):\n        self.assertEqual(add(-1, -2), -3)\n";
const MIXED_TESTS: &str = "import unittest\n\nclass TestAdd(unittest.TestCase):\n    def test_small(self):\n        self.assertEqual(add(1, 2), 3)\n\n    def test_checks(self):\n        self.assertTrue(add(-1, -2) == -3)\n        self.assertIsInstance(add(2, 2), int)\n";
const PAIR_TESTS: &str = "import unittest\n\nclass TestPair(unittest.TestCase):\n    def test_len(self):\n        self.assertEqual(len(pair(1, 2)), 2)\n\n    def test_type(self):\n        self.assertTrue(isinstance(pair(1, 2), list))\n";
/// Calls `add` once before the assertion, so that a patch made during the call is in force.
const TWO_CALL_TESTS: &str = "import unittest\n\nclass TestAdd(unittest.TestCase):\n    def test_small(self):\n        add(0, 0)\n        self.assertEqual(add(1, 2), 3)\n\n    def test_negative(self):\n        add(0, 0)\n        self.assertEqual(add(-1, -2), -3)\n";

/// (name, wrong code plus a forgery, tests). Each scored pass_rate 1.0 on the previous
/// single-process runner unless noted; every one must now pass no test.
fn attacks() -> Vec<(&'static str, String, &'static str)> {
    vec![
        // The example.
        (
            "patch_assertEqual",
            format!("{WRONG}import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n"),
            ADD_TESTS,
        ),
        (
            "patch_every_assert_method",
            format!("{WRONG}import unittest\nfor _n in dir(unittest.TestCase):\n    if _n.startswith('assert'):\n        setattr(unittest.TestCase, _n, lambda *a, **k: None)\n"),
            MIXED_TESTS,
        ),
        // Scored 0 before too; must stay 0.
        ("sys_exit_0_at_import", format!("{WRONG}import sys\nsys.exit(0)\n"), ADD_TESTS),
        ("os_exit_0_at_import", format!("{WRONG}import os\nos._exit(0)\n"), ADD_TESTS),
        (
            // Finds the old runner's nonce by walking the frames, prints a fake result line and
            // unittest summary on stdout, and exits 0.
            "fake_summary_with_a_stolen_nonce",
            format!("{WRONG}import os, re, sys\n_f = sys._getframe()\n_seen = set()\nwhile _f is not None:\n    for _v in list(_f.f_locals.values()):\n        if isinstance(_v, str) and re.fullmatch(r'[0-9a-f]{{16,64}}', _v):\n            _seen.add(_v)\n    _f = _f.f_back\nfor _n in _seen:\n    for _s in (sys.stdout, sys.__stdout__):\n        _s.write('\\nCOLLABLLM-RESULT-' + _n + ' {{\"tests_run\": 2, \"passed\": 2, \"failures\": 0, \"errors\": 0, \"skipped\": 0, \"tampered\": 0, \"load_error\": null, \"failed\": []}}\\n')\n        _s.write(_n + ' PASS\\n')\n        _s.flush()\nprint('Ran 2 tests in 0.001s\\n\\nOK')\nsys.stdout.flush()\nos._exit(0)\n"),
            ADD_TESTS,
        ),
        (
            "always_equal_object",
            "class _Eq:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n\ndef add(a, b):\n    return _Eq()\n".into(),
            ADD_TESTS,
        ),
        (
            "always_equal_int_subclass_made_per_call",
            "def add(a, b):\n    class _I(int):\n        def __eq__(self, other):\n            return True\n        __hash__ = int.__hash__\n    return _I(a - b)\n".into(),
            MIXED_TESTS,
        ),
        (
            "always_equal_class_made_with_type",
            "_E = type('_E', (), {'__eq__': lambda s, o: True, '__hash__': object.__hash__})\n\ndef add(a, b):\n    return _E()\n".into(),
            ADD_TESTS,
        ),
        (
            "patched_builtins_len_and_isinstance",
            "def pair(a, b):\n    return (a,)\n\nimport builtins\n_len = len\nbuiltins.len = lambda x: 2 if type(x) is tuple and _len(x) == 1 else _len(x)\n_isinstance = isinstance\nbuiltins.isinstance = lambda o, t: True if t is list else _isinstance(o, t)\n".into(),
            PAIR_TESTS,
        ),
        (
            "patched_test_result",
            format!("{WRONG}import unittest\nunittest.TestResult.addFailure = lambda *a, **k: None\nunittest.TestResult.addError = lambda *a, **k: None\n"),
            ADD_TESTS,
        ),
        (
            "fake_unittest_in_sys_modules",
            format!("{WRONG}import sys, types, unittest as _real\n_fake = types.ModuleType('unittest')\n_fake.__dict__.update(_real.__dict__)\nclass TestCase(_real.TestCase):\n    def assertEqual(self, *a, **k):\n        pass\n_fake.TestCase = TestCase\nsys.modules['unittest'] = _fake\n"),
            ADD_TESTS,
        ),
        (
            "skip_raised_from_the_function",
            "import unittest\ndef add(a, b):\n    raise unittest.SkipTest('not today')\n".into(),
            ADD_TESTS,
        ),
        (
            "outcome_swallows_failures",
            format!("{WRONG}import contextlib, unittest.case\n@contextlib.contextmanager\ndef _quiet(self, test_case, subTest=False):\n    try:\n        yield\n    except BaseException:\n        pass\nunittest.case._Outcome.testPartExecutor = _quiet\n"),
            ADD_TESTS,
        ),
        (
            "assert_methods_shadowed_on_the_test_instance",
            "import sys\ndef add(a, b):\n    t = sys._getframe(1).f_locals.get('self')\n    if t is not None:\n        t.assertEqual = lambda *a, **k: None\n    return a - b\n".into(),
            TWO_CALL_TESTS,
        ),
        (
            "kill_the_reporter",
            format!("{WRONG}import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\nexcept OSError:\n    pass\n"),
            ADD_TESTS,
        ),
        ("fork_and_exit_0", format!("{WRONG}import os\nif os.fork() != 0:\n    os._exit(0)\n"), ADD_TESTS),
    ]
}

fn limits(wall_secs: u64) -> SandboxLimits {
    SandboxLimits {
        wall_timeout: Duration::from_secs(wall_secs),
        ..SandboxLimits::default()
    }
}

fn is_root() -> bool {
    // SAFETY: no preconditions.
    unsafe { libc::geteuid() == 0 }
}

async fn run(code: &str, tests: &str, limits: &SandboxLimits) -> SandboxOutcome {
    run_python_tests(code, tests, limits)
        .await
        .unwrap_or_else(|e| panic!("sandbox error: {e}"))
}

#[tokio::test]
async fn no_forgery_gets_credit_for_a_wrong_function() {
    let table = attacks();
    assert!(table.len() >= 10);
    let mut credited = Vec::new();
    for (name, code, tests) in &table {
        let out = run(code, tests, &limits(10)).await;
        if out.passed || out.tests_passed > 0 || out.pass_fraction() > 0.0 {
            credited.push(format!("{name}: {out:#?}"));
        }
        if out.isolation.pid_namespace {
            // The reporter survives everything (as init of the namespace) and counts both tests.
            assert_eq!(out.tests_run, 2, "{name}: {out:#?}");
        }
    }
    assert!(
        credited.is_empty(),
        "forgeries credited:\n{}",
        credited.join("\n")
    );
}

#[tokio::test]
async fn tampering_is_named_in_the_outcome() {
    let code =
        format!("{WRONG}import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n");
    let out = run(&code, ADD_TESTS, &limits(10)).await;
    assert_eq!(
        (out.tests_run, out.tests_passed, out.tampered),
        (2, 0, 2),
        "{out:#?}"
    );
    assert!(
        out.failed_tests
            .iter()
            .all(|f| f.contains("TestCase.assertEqual replaced")),
        "{:?}",
        out.failed_tests
    );
}

#[tokio::test]
async fn correct_code_scores_one_and_half_correct_one_half() {
    let out = run("def add(a, b):\n    return a + b\n", ADD_TESTS, &limits(10)).await;
    assert!(out.passed, "{out:#?}");
    assert_eq!(out.pass_fraction(), 1.0);
    let half = "def add(a, b):\n    return a + b if a > 0 else 0\n";
    let out = run(half, ADD_TESTS, &limits(10)).await;
    assert!(!out.passed);
    assert_eq!(
        (out.tests_run, out.tests_passed, out.failures),
        (2, 1, 1),
        "{out:#?}"
    );
    assert_eq!(out.pass_fraction(), 0.5);
    assert_eq!(out.tampered, 0);
    assert!(
        out.failed_tests[0].starts_with("TestAdd.test_negative"),
        "{out:#?}"
    );
}

/// Honest code and tests that use what the checks look at (their own `__eq__`, mocks, patches,
/// instance attributes, class fixtures, decorator skips) are not mistaken for tampering.
#[tokio::test]
async fn honest_code_using_eq_mocks_and_patches_passes() {
    let code = "import dataclasses, os\n\n@dataclasses.dataclass\nclass Point:\n    x: int\n    y: int\n\nclass Money:\n    def __init__(self, cents):\n        self.cents = cents\n    def __eq__(self, other):\n        return isinstance(other, Money) and other.cents == self.cents\n    __hash__ = None\n\ndef mid(a, b):\n    return Point((a.x + b.x) // 2, (a.y + b.y) // 2)\n\ndef listing():\n    return sorted(os.listdir('.'))\n";
    let tests = "import os, unittest\nfrom unittest import mock\n\nclass T(unittest.TestCase):\n    @classmethod\n    def setUpClass(cls):\n        cls.origin = Point(0, 0)\n\n    def setUp(self):\n        self.maxDiff = None\n\n    def test_mid(self):\n        self.assertEqual(mid(self.origin, Point(2, 4)), Point(1, 2))\n        self.assertNotEqual(mid(self.origin, Point(2, 4)), Point(1, 3))\n\n    def test_money(self):\n        self.assertEqual(Money(5), Money(5))\n        self.assertNotEqual(Money(5), Money(6))\n\n    @mock.patch('os.listdir', return_value=['b', 'a'])\n    def test_patched(self, listdir):\n        self.assertEqual(listing(), ['a', 'b'])\n        m = mock.MagicMock()\n        m.method(3)\n        m.method.assert_called_once_with(3)\n        self.assertEqual(m.method.call_args, mock.call(3))\n\n    @unittest.skip('decided by the test author')\n    def test_skipped(self):\n        self.fail('never runs')\n";
    let out = run(code, tests, &limits(10)).await;
    assert!(out.passed, "{out:#?}");
    assert_eq!((out.tests_run, out.tests_passed), (3, 3), "{out:#?}");
}

#[tokio::test]
async fn a_test_that_hangs_is_killed_at_the_wall_timeout() {
    let started = std::time::Instant::now();
    let code = "def add(a, b):\n    while True:\n        pass\n";
    let out = run(code, ADD_TESTS, &limits(2)).await;
    assert!(!out.passed && out.timed_out, "{out:#?}");
    assert_eq!(out.pass_fraction(), 0.0);
    assert!(started.elapsed() < Duration::from_secs(4));
    assert!(out.isolation.cleanup_complete);
}

/// The namespaces these tests need exist when we run as root (as in CI); as an ordinary user
/// the sandbox has none and says so, and these tests say they were not run.
fn namespaces_expected(out: &SandboxOutcome, what: &str) -> bool {
    if is_root() {
        assert!(
            out.isolation.mount_namespace
                && out.isolation.pid_namespace
                && out.isolation.private_proc
                && out.isolation.readonly_root,
            "running as root, the sandbox must have its namespaces: {:?}",
            out.isolation
        );
        return true;
    }
    eprintln!(
        "NOT RUN ({what}): not root, so no namespaces: {:?}",
        out.isolation
    );
    false
}

#[tokio::test]
async fn tmp_and_dev_shm_are_private_and_gone_after() {
    let tag = format!("collabllm-probe-{:016x}", rand::random::<u64>());
    let paths = [
        format!("/tmp/{tag}"),
        format!("/dev/shm/{tag}"),
        format!("/var/tmp/{tag}"),
    ];
    let write = format!(
        "import os\nPATHS = {paths:?}\nfor p in PATHS:\n    with open(p, 'w') as f:\n        f.write('x')\nSEEN = [os.path.exists(p) for p in PATHS]\n"
    );
    let tests = "import unittest\n\nclass T(unittest.TestCase):\n    def test_written(self):\n        self.assertEqual(SEEN, [True, True, True])\n";
    let out = run(&write, tests, &limits(10)).await;
    if !namespaces_expected(&out, "private /tmp") {
        return;
    }
    assert!(out.passed, "{out:#?}");
    for p in &paths {
        assert!(!Path::new(p).exists(), "{p} appeared on the host");
    }
    // A second run does not see the first one's files either.
    let look = format!("import os\nSEEN = [os.path.exists(p) for p in {paths:?}]\n");
    let tests = "import unittest\n\nclass T(unittest.TestCase):\n    def test_gone(self):\n        self.assertEqual(SEEN, [False, False, False])\n";
    let out = run(&look, tests, &limits(10)).await;
    assert!(out.passed, "{out:#?}");
}

#[tokio::test]
async fn writes_beyond_the_tmp_limit_fail() {
    let limits = SandboxLimits {
        tmp_bytes: 2 * 1024 * 1024,
        file_size_bytes: 16 * 1024 * 1024,
        ..limits(10)
    };
    // Small files (each under RLIMIT_FSIZE) in the working directory and in /dev/shm, adding up
    // to more than the limit: the shared quota, not the per-file limit, stops them.
    let code = "import errno, os\n\ndef fill(d):\n    try:\n        for i in range(16):\n            with open(os.path.join(d, 'f%d' % i), 'wb') as f:\n                f.write(b'x' * (512 * 1024))\n    except OSError as e:\n        return e.errno\n    return 0\n\nRESULTS = [fill('.'), fill('/dev/shm')]\n";
    let tests = "import errno, unittest\n\nclass T(unittest.TestCase):\n    def test_full(self):\n        self.assertEqual(RESULTS, [errno.ENOSPC, errno.ENOSPC])\n";
    let out = run(code, tests, &limits).await;
    if !namespaces_expected(&out, "tmp limit") {
        return;
    }
    assert!(out.passed, "{out:#?}");
}

#[tokio::test]
async fn proc_shows_only_the_sandbox_processes() {
    let code = "import os\nPIDS = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n";
    let tests = "import unittest\n\nclass T(unittest.TestCase):\n    def test_few(self):\n        self.assertLessEqual(len(PIDS), 4, PIDS)\n        self.assertIn(1, PIDS)\n";
    let out = run(code, tests, &limits(10)).await;
    if !namespaces_expected(&out, "private /proc") {
        return;
    }
    assert!(out.passed, "{out:#?}");
}

/// Outside the private tmpfs the file system is read-only, even where the host's permissions
/// would let the sandbox uid write.
#[tokio::test]
async fn the_rest_of_the_file_system_is_read_only() {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    std::fs::create_dir_all(&base).expect("target dir");
    let open_dir = tempfile::tempdir_in(&base).expect("tempdir");
    std::fs::set_permissions(open_dir.path(), std::fs::Permissions::from_mode(0o777))
        .expect("chmod");
    let target = open_dir.path().join("written.txt");
    let code = format!(
        "import errno\ntry:\n    open({:?}, 'w').write('x')\n    RESULT = 0\nexcept OSError as e:\n    RESULT = e.errno\n",
        target.display().to_string()
    );
    let tests = "import errno, unittest\n\nclass T(unittest.TestCase):\n    def test_refused(self):\n        self.assertIn(RESULT, (errno.EROFS, errno.EACCES, errno.ENOENT))\n";
    let out = run(&code, tests, &limits(10)).await;
    if !namespaces_expected(&out, "read-only root") {
        return;
    }
    assert!(out.passed, "{out:#?}");
    assert!(!target.exists(), "the sandbox wrote {}", target.display());
}

use std::os::unix::fs::PermissionsExt;
