//! Range checks of the numbers a user gives (flags and config-file fields), with one wording
//! everywhere: `<name> <value>: must be a finite number <range>`. Leaf utility: binaries use
//! [`Range::parser`] as a clap value parser; config structs call [`Range::check`] in their
//! `validate`, so a value read from a file gets the same check as the flag.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Bound {
    Unbounded,
    Closed(f64),
    Open(f64),
}

/// The finite numbers a setting accepts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Range {
    lo: Bound,
    hi: Bound,
}

impl Range {
    /// `>= lo`.
    pub const fn at_least(lo: f64) -> Self {
        Self {
            lo: Bound::Closed(lo),
            hi: Bound::Unbounded,
        }
    }
    /// `> lo`.
    pub const fn above(lo: f64) -> Self {
        Self {
            lo: Bound::Open(lo),
            hi: Bound::Unbounded,
        }
    }
    /// `[lo, hi]`.
    pub const fn closed(lo: f64, hi: f64) -> Self {
        Self {
            lo: Bound::Closed(lo),
            hi: Bound::Closed(hi),
        }
    }
    /// `[lo, hi)`.
    pub const fn closed_open(lo: f64, hi: f64) -> Self {
        Self {
            lo: Bound::Closed(lo),
            hi: Bound::Open(hi),
        }
    }
    /// `(lo, hi]`.
    pub const fn open_closed(lo: f64, hi: f64) -> Self {
        Self {
            lo: Bound::Open(lo),
            hi: Bound::Closed(hi),
        }
    }
    /// Any finite number.
    pub const fn finite() -> Self {
        Self {
            lo: Bound::Unbounded,
            hi: Bound::Unbounded,
        }
    }

    pub fn contains(&self, v: f64) -> bool {
        let lo = match self.lo {
            Bound::Unbounded => true,
            Bound::Closed(x) => v >= x,
            Bound::Open(x) => v > x,
        };
        let hi = match self.hi {
            Bound::Unbounded => true,
            Bound::Closed(x) => v <= x,
            Bound::Open(x) => v < x,
        };
        v.is_finite() && lo && hi
    }

    /// `v` when it is in range, else the message naming `name` and `v`.
    pub fn check(&self, name: &str, v: f64) -> Result<f64, String> {
        if self.contains(v) {
            Ok(v)
        } else {
            // Debug keeps 1e30 short and 1 as 1.0.
            Err(format!("{name} {v:?}: {}", self.requirement()))
        }
    }

    /// `must be a finite number >= 0` (without the name), as clap prints after the flag.
    pub fn requirement(&self) -> String {
        format!("must be a finite number {self}")
    }

    /// A clap value parser: the number, or the requirement (clap names the flag and value).
    pub fn parser(self) -> impl Fn(&str) -> Result<f64, String> + Clone + Send + Sync + 'static {
        move |s: &str| {
            let v: f64 = s
                .trim()
                .parse()
                .map_err(|_| format!("not a number; {}", self.requirement()))?;
            if self.contains(v) {
                Ok(v)
            } else {
                Err(self.requirement())
            }
        }
    }
}

impl fmt::Display for Range {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.lo, self.hi) {
            (Bound::Unbounded, Bound::Unbounded) => Ok(()),
            (Bound::Closed(x), Bound::Unbounded) => write!(f, ">= {x}"),
            (Bound::Open(x), Bound::Unbounded) => write!(f, "> {x}"),
            (Bound::Unbounded, Bound::Closed(x)) => write!(f, "<= {x}"),
            (Bound::Unbounded, Bound::Open(x)) => write!(f, "< {x}"),
            (lo, hi) => {
                let (l, a) = match lo {
                    Bound::Closed(x) => ('[', x),
                    Bound::Open(x) => ('(', x),
                    Bound::Unbounded => unreachable!("handled above"),
                };
                let (r, b) = match hi {
                    Bound::Closed(x) => (']', x),
                    Bound::Open(x) => (')', x),
                    Bound::Unbounded => unreachable!("handled above"),
                };
                write!(f, "in {l}{a}, {b}{r}")
            }
        }
    }
}

/// `text` cut to at most `max` bytes on a character boundary, marked with `…` when cut: the
/// form in which a user's or a client's string is echoed in an error or a log line, so a
/// megabyte key never becomes a megabyte message.
pub fn clip(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// An integer setting that must be at least `min`: `name value: must be at least min`.
pub fn at_least(name: &str, v: usize, min: usize) -> Result<usize, String> {
    if v >= min {
        Ok(v)
    } else {
        Err(format!("{name} {v}: must be at least {min}"))
    }
}

/// An integer setting that must lie in `min..=max`: sizes beyond what any model or machine
/// can hold are refused before work starts, not by an allocation failure later.
pub fn in_range(name: &str, v: usize, min: usize, max: usize) -> Result<usize, String> {
    if v > max {
        return Err(format!("{name} {v}: must be at most {max}"));
    }
    at_least(name, v, min)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_setting_value_and_range() {
        let r = Range::at_least(0.0);
        assert_eq!(
            r.check("--weight-decay", f64::NAN).unwrap_err(),
            "--weight-decay NaN: must be a finite number >= 0"
        );
        assert_eq!(
            Range::closed_open(0.0, 1.0)
                .check("--warmup-ratio", 1.0)
                .unwrap_err(),
            "--warmup-ratio 1.0: must be a finite number in [0, 1)"
        );
        assert_eq!(
            Range::open_closed(0.0, 86400.0)
                .check("timeout_s", 1e30)
                .unwrap_err(),
            "timeout_s 1e30: must be a finite number in (0, 86400]"
        );
        assert_eq!(Range::above(0.0).check("--beta", 0.5), Ok(0.5));
        assert!(Range::finite().check("w", f64::INFINITY).is_err());
        assert!(Range::finite().check("w", -3.0).is_ok());
    }

    #[test]
    fn clip_cuts_on_a_character_boundary() {
        assert_eq!(clip("short", 80), "short");
        assert_eq!(clip("ééé", 3), "é…");
        assert!(clip(&"k".repeat(1 << 20), 80).len() <= 80 + "…".len());
    }

    #[test]
    fn bounds_are_exact() {
        let r = Range::open_closed(0.0, 1.0);
        assert!(!r.contains(0.0) && r.contains(1.0) && r.contains(1e-300));
        let r = Range::closed_open(0.0, 0.5);
        assert!(r.contains(0.0) && !r.contains(0.5));
        assert!(!Range::at_least(0.0).contains(-0.0 - 1e-12));
    }

    #[test]
    fn parser_refuses_non_finite_and_out_of_range_text() {
        let p = Range::at_least(0.0).parser();
        assert_eq!(p("0.01"), Ok(0.01));
        for bad in ["NaN", "inf", "-1", "1e400", "x"] {
            let err = p(bad).unwrap_err();
            assert!(err.contains("must be a finite number >= 0"), "{bad}: {err}");
        }
    }

    #[test]
    fn integer_minimum() {
        assert_eq!(
            at_least("--save-steps", 0, 1).unwrap_err(),
            "--save-steps 0: must be at least 1"
        );
        assert_eq!(at_least("--save-steps", 5, 1), Ok(5));
    }
}
