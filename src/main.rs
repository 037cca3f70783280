//! The metainfer CLI: parse the command line, set up logging and pipes, run, map the result to an
//! exit status (0 the check passed, 1 it ran and failed, 2 bad usage or input). Every command but
//! `serve` and `demo` restores SIGPIPE's default, so a closed pipe ends a filter quietly. Everything
//! else is in `cli` (arguments and their mapping to library calls) and in the library.

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = cli::args::Cli::parse();
    // A closed pipe (`metainfer ledger | head -1`) ends the process quietly, as for any Unix filter;
    // the server and the demo keep SIGPIPE ignored, since they write to child processes and
    // clients that may go away, and handle those errors themselves.
    if !matches!(args.command, cli::args::Command::Serve { .. } | cli::args::Command::Demo { .. }) {
        // SAFETY: restoring the default disposition of SIGPIPE before any thread is started.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    quiet_on_broken_pipe();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("METAINFER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    // SIGTERM, SIGINT and SIGHUP kill every child process group before the process exits.
    if let Err(e) = metainfer::harness::exit_on_signals() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let result = cli::run(args);
    // A signal killed the children this command waited for: its exit belongs to the signal thread.
    metainfer::harness::wait_if_terminating();
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

/// A print to a closed stdout (the demo piped into `head`) exits quietly instead of panicking with
/// a backtrace.
fn quiet_on_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.contains("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(141);
        }
        default(info);
    }));
}
