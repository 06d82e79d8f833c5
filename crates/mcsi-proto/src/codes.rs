//! Response and function codes of task management and logout (RFC 7143 11.5, 11.6, 11.14,
//! 11.15), shared by both sides.

/// TMF response codes (11.6.1).
pub mod tmf_response {
    pub const COMPLETE: u8 = 0;
    pub const NO_TASK: u8 = 1;
    pub const NO_LUN: u8 = 2;
    pub const STILL_ALLEGIANT: u8 = 3;
    pub const REASSIGN_NOT_SUPPORTED: u8 = 4;
    pub const NOT_SUPPORTED: u8 = 5;
    pub const AUTH_FAILED: u8 = 6;
}

/// TMF function codes (11.5.1).
pub mod tmf_function {
    pub const ABORT_TASK: u8 = 1;
    pub const ABORT_TASK_SET: u8 = 2;
    pub const CLEAR_ACA: u8 = 3;
    pub const CLEAR_TASK_SET: u8 = 4;
    pub const LUN_RESET: u8 = 5;
    pub const TARGET_WARM_RESET: u8 = 6;
    pub const TARGET_COLD_RESET: u8 = 7;
    pub const TASK_REASSIGN: u8 = 8;

    /// The function's name in RFC 7143 11.5.1, for logs.
    pub fn name(f: u8) -> &'static str {
        match f {
            ABORT_TASK => "ABORT TASK",
            ABORT_TASK_SET => "ABORT TASK SET",
            CLEAR_ACA => "CLEAR ACA",
            CLEAR_TASK_SET => "CLEAR TASK SET",
            LUN_RESET => "LOGICAL UNIT RESET",
            TARGET_WARM_RESET => "TARGET WARM RESET",
            TARGET_COLD_RESET => "TARGET COLD RESET",
            TASK_REASSIGN => "TASK REASSIGN",
            _ => "unknown",
        }
    }
}

/// Logout response codes (11.15.1).
pub mod logout_response {
    pub const CLOSED: u8 = 0;
    pub const CID_NOT_FOUND: u8 = 1;
    pub const RECOVERY_NOT_SUPPORTED: u8 = 2;
}

/// Logout reason codes (11.14.1).
pub mod logout_reason {
    pub const CLOSE_SESSION: u8 = 0;
    pub const CLOSE_CONNECTION: u8 = 1;
    pub const RECOVERY: u8 = 2;
}
